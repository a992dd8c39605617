"""Run outputs: per-step metrics (JSONL) and the run summary (JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class RunWriter:
    """Owns a run directory: ``metrics.jsonl`` (one line per step) and ``summary.json``."""

    def __init__(self, out: str | Path) -> None:
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_path.write_text("")

    def step(self, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(_clean(metrics)) + "\n")

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(_clean(data), indent=2) + "\n")
        return path
