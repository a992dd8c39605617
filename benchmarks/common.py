"""What every benchmark script records the same way: the machine it ran on and its JSON report."""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def ensure_models(config: Path, overrides: list[str] | None = None) -> None:
    """Make sure the job's policy and judge checkpoints exist before a benchmark starts real runs.

    The bundled ones (``models/policy`` and ``models/judge`` under the repository) are built by our own
    recipe when missing, as ``make prepare`` would (several minutes on a CPU); any other missing
    directory stops the benchmark with a message naming it."""
    from pivotrl.config import load_config
    from pivotrl.recipes.prepare import prepare

    cfg = load_config(config, overrides or [])
    bundled = {ROOT / "models/policy", ROOT / "models/judge"}
    missing = [Path(p) for p in (cfg.policy.path, cfg.judge.path) if not (Path(p) / "config.json").is_file()]
    if not missing:
        return
    foreign = [str(p) for p in missing if p not in bundled]
    if foreign:
        raise SystemExit(
            f"checkpoint directory {foreign[0]!r} holds no config.json; point policy.path and judge.path at"
            " checkpoints, or run from the repository root with models/policy and models/judge to have them"
            f" built (relative paths are taken from the working directory, {os.getcwd()})"
        )
    print("building the bundled policy and judge (pivotrl prepare, a few minutes) ...", flush=True)
    prepare(ROOT / "models", ROOT / "data/arithmetic")


def parse_size(text: str) -> int:
    """A parameter count from the command line: ``500K``, ``25M``, ``1G`` or a plain number."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 1M, 25M, 500K") from None
