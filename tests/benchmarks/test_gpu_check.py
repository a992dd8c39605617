"""``benchmarks/gpu_check.py``: its no-CUDA path and its refusal of an unknown section."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = gpu_check("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device here")
    assert not out.exists()


def test_gpus_torch_does_not_see_fail_the_check_in_one_line(tmp_path: Path) -> None:
    """nvidia-smi (a fake one here) lists a GPU, and torch sees none with the CUDA_VISIBLE_DEVICES given."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "GPU-not-there"}
    proc = gpu_check("--out", str(tmp_path / "report.json"), env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H100")
    assert "sees no CUDA device with CUDA_VISIBLE_DEVICES='GPU-not-there'" in lines[0]


def test_unknown_section_is_refused() -> None:
    proc = gpu_check("--only", "gps_load,warp")
    assert proc.returncode == 2 and "unknown sections ['warp']" in proc.stderr
