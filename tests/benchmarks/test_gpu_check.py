"""``benchmarks/gpu_check.py``: its no-CUDA path and its refusal of an unknown section."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = gpu_check("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device here")
    assert not out.exists()


def test_unknown_section_is_refused() -> None:
    proc = gpu_check("--only", "gps_load,warp")
    assert proc.returncode == 2 and "unknown sections ['warp']" in proc.stderr
