"""What every benchmark script records the same way: the machine it ran on and its JSON report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def machine(load_at_start: list[float]) -> dict[str, Any]:
    """The machine, and how busy it was: other processes skew absolute numbers, not paired ratios."""
    return {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(load_at_start),
        "load_average_at_end": list(os.getloadavg()),
    }


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def simulate(config: Path, overrides: list[str], out: Path, timeout: float) -> tuple[float, str | None]:
    """``pivotrl simulate`` in its own process: its wall seconds, and the error that stopped it (the
    last line it printed, or the timeout), None if it finished."""
    cmd = [sys.executable, "-m", "pivotrl.cli", "simulate", str(config), *overrides, "--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, f"stopped after {timeout:.0f} s"
    error = (
        None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    )
    return time.perf_counter() - t0, error


def parse_size(text: str) -> int:
    """A parameter count from the command line: ``500K``, ``25M``, ``1G`` or a plain number."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 1M, 25M, 500K") from None
