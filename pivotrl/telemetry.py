"""Run outputs: per-step metrics, the run summary, and what each device did when.

* ``metrics.jsonl`` - one line per step.
* ``samples.jsonl`` - one line per sample: step, uid, response tokens and text,
  reward, verdict, whether the checker agrees, migrations. Two runs of the same
  job can be compared sample by sample (``pivotrl compare``).
* ``summary.json`` - the run's headline numbers.
* ``events.jsonl`` - one line per activity slice: device, role, name, start, end.
* ``trace.json`` - the same slices in Chrome trace-event format (one track per
  device; opens in Perfetto or chrome://tracing).
* ``timeline.png`` - devices x time, coloured by role.

The simulator (``pivotrl simulate``) writes the same files, so a real run and a
simulated one can be compared side by side.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLE_COLORS = {
    "rollout": "#4c78a8",
    "genrm": "#f58518",
    "train": "#54a24b",
    "shift": "#e45756",
    "migrate": "#222222",
}


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


@dataclass(slots=True)
class Slice:
    """One activity of one device: ``role`` says which role's work it was."""

    device: int
    role: str
    name: str
    start: float  # seconds since the run started
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Collects slices against one run clock."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.slices: list[Slice] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, device: int, role: str, name: str, start: float, end: float, **args: Any) -> None:
        self.slices.append(Slice(device, role, name, start, end, args))


class RunWriter:
    """Owns a run directory and writes every file in it."""

    def __init__(self, out: str | Path) -> None:
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        self.samples_path = self.dir / "samples.jsonl"
        self.samples_path.write_text("")

    def step(self, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(_clean(metrics)) + "\n")

    def samples(self, rows: Iterable[dict[str, Any]]) -> None:
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(_clean(data), indent=2) + "\n")
        return path

    def write_events(self, slices: list[Slice], title: str = "") -> None:
        with (self.dir / "events.jsonl").open("w") as f:
            for s in slices:  # asdict's fields without its deep copy: a simulated run has 10^5 slices
                row = dict(device=s.device, role=s.role, name=s.name, start=s.start, end=s.end, args=s.args)
                f.write(json.dumps(row) + "\n")
        write_trace(slices, self.dir / "trace.json")
        draw_timeline(slices, self.dir / "timeline.png", title)


def read_events(run_dir: str | Path) -> list[Slice]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no events.jsonl (is it a pivotrl run directory?)")
    return [Slice(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def write_trace(slices: Iterable[Slice], path: str | Path) -> None:
    """Chrome trace-event JSON: a complete event ("X") per slice, a thread per device."""
    slices = list(slices)
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "pivotrl"}}]
    for d in sorted({s.device for s in slices}):
        events.append({"ph": "M", "pid": 0, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
    for s in slices:
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": s.device,
                "name": s.name,
                "cat": s.role,
                "ts": round(s.start * 1e6, 3),
                "dur": round(max(0.0, s.end - s.start) * 1e6, 3),
                "args": {"role": s.role, **_clean(s.args)},
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def draw_timeline(slices: Iterable[Slice], path: str | Path, title: str = "") -> None:
    """Devices x time, one bar per slice, coloured by role. One collection of bars per role, and
    rows that thin out past a few dozen devices, so a thousand devices draw in about a second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    slices = list(slices)
    devices = sorted({s.device for s in slices}) or [0]
    end = max((s.end for s in slices), default=1.0)
    begin = min((s.start for s in slices), default=0.0) if slices and min(s.start for s in slices) > 0.2 * end else 0.0
    row = 0.55 if len(devices) <= 32 else max(0.02, 17.6 / len(devices))  # at most ~20 inches of rows
    fig, ax = plt.subplots(figsize=(12, 1.6 + row * len(devices)))
    bars: dict[str, list] = {}
    merge = (end - begin) / 4000  # bars of one role closer than this (well under a pixel) are drawn as one
    last: dict[int, list] = {}  # device -> its latest bar [role, x0, x1]
    for s in sorted(slices, key=lambda s: (s.device, s.start)):
        x0, x1 = s.start, s.start + max(s.end - s.start, end * 1e-4)
        bar = last.get(s.device)
        if bar is not None and bar[0] == s.role and x0 - bar[2] <= merge:
            bar[2] = max(bar[2], x1)
            continue
        if bar is not None:
            bars.setdefault(bar[0], []).append((s.device, bar[1], bar[2]))
        last[s.device] = [s.role, x0, x1]
    for d, (role, x0, x1) in last.items():
        bars.setdefault(role, []).append((d, x0, x1))
    for role, rows in bars.items():
        verts = [[(x0, d - 0.4), (x1, d - 0.4), (x1, d + 0.4), (x0, d + 0.4)] for d, x0, x1 in rows]
        color = ROLE_COLORS.get(role, "#999999")
        ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors="none"), autolim=False)
    every = max(1, math.ceil(len(devices) / 32))  # label at most ~32 rows
    ax.set_yticks(devices[::every], [f"device {d}" for d in devices[::every]])
    ax.set_ylim(min(devices) - 0.6, max(devices) + 0.6)
    ax.invert_yaxis()
    ax.set_xlim(begin, end)
    ax.set_xlabel("seconds since start")
    roles = [r for r in ROLE_COLORS if r in bars]
    handles = [Patch(color=ROLE_COLORS[r], label=r) for r in roles]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(roles) or 1, frameon=False)
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
