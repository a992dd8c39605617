"""Run outputs: per-step metrics, the run summary, and what each device did when.

* ``metrics.jsonl`` - one line per step.
* ``samples.jsonl`` - one line per sample: step, uid, response tokens and text,
  reward, verdict, judgment tokens, whether the checker agrees, migrations. Two runs of the same
  job can be compared sample by sample (``pivotrl compare``).
* ``summary.json`` - the run's headline numbers.
* ``events.jsonl`` - one line per activity slice: device, role, name, start, end.
* ``trace.json`` - the same slices in Chrome trace-event format (one track per
  device; opens in Perfetto or chrome://tracing).
* ``timeline.png`` - devices x time, coloured by role.
* ``tensorboard/``, ``wandb/`` - the same numbers for TensorBoard and W&B, when ``log.tensorboard`` or
  ``log.wandb`` is on (:mod:`pivotrl.tracking`).

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

import orjson

from pivotrl.errors import UserError

ROLE_COLORS = {
    "rollout": "#4c78a8",
    "judge": "#f58518",
    "train": "#54a24b",
    "shift": "#e45756",
    "migrate": "#222222",
}


def _plain(value: Any) -> Any:
    """What orjson cannot write itself: numpy scalars (``item``)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS  # numpy values; int keys as strings, as json does


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    """Rows as JSON lines; non-finite numbers as null (JSON has none). One orjson call over the whole
    list, cut between rows, when every row begins with the same key: a run's 10^5 slices or samples
    take a tenth of the time of one call each. The cut is checked: a row that held the separator
    inside it (a nested object beginning with that key) makes the count wrong, and then each row
    is written alone."""
    if not rows:
        return b""
    options = _OPTIONS
    first = next(iter(rows[0]), None)
    if first is not None and all(next(iter(r), None) == first for r in rows):
        whole = orjson.dumps(rows, default=_plain, option=options)
        head = b"{" + orjson.dumps(first) + b":"
        if whole.count(b"}," + head) == len(rows) - 1:
            return whole[1:-1].replace(b"}," + head, b"}\n" + head) + b"\n"
    return b"".join(orjson.dumps(r, default=_plain, option=options | orjson.OPT_APPEND_NEWLINE) for r in rows)


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


# what a run writes into its directory (tracking's folders included): a directory holding any of them holds a run
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "samples.jsonl",
    "summary.json",
    "events.jsonl",
    "trace.json",
    "timeline.png",
    "decisions.jsonl",
    "policy",
    "checkpoints",
    "tensorboard",
    "wandb",
)
ROW_FILES = ("metrics.jsonl", "samples.jsonl")  # the files a resumed run cuts back to its checkpoint's rows


def run_files(run_dir: str | Path) -> list[str]:
    """The names of :data:`RUN_FILES` already in ``run_dir``: a new run written there would overwrite them."""
    d = Path(run_dir)
    return [name for name in RUN_FILES if (d / name).exists()] if d.is_dir() else []


def _kept_lines(path: Path, rows: int) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)[:rows] if rows and path.is_file() else []


def missing_rows(run_dir: str | Path, keep: tuple[int, int]) -> str | None:
    """Why ``run_dir``'s metrics and samples cannot be cut back to the ``keep = (metrics rows, samples rows)``
    its checkpoint saw (a file holds fewer), or None when both can."""
    for name, rows in zip(ROW_FILES, keep, strict=True):
        have = len(_kept_lines(Path(run_dir) / name, rows))
        if have < rows:
            return f"{Path(run_dir) / name} has {have} rows, its checkpoint saw {rows}"
    return None


class RunWriter:
    """Owns a run directory and writes every file in it."""

    def __init__(self, out: str | Path, keep: tuple[int, int] | None = None) -> None:
        """A new run starts its metrics and samples empty; a resumed one (``keep``) keeps their first
        ``keep = (metrics rows, samples rows)`` lines, those its checkpoint had seen, and drops the rest.
        Both files are checked before either is cut: a refused resume leaves them as they were."""
        self.dir = Path(out)
        self.metrics_path, self.samples_path = (self.dir / name for name in ROW_FILES)
        if keep is not None and (short := missing_rows(self.dir, keep)):
            raise ValueError(short)
        self.dir.mkdir(parents=True, exist_ok=True)
        for path, rows in zip((self.metrics_path, self.samples_path), keep or (0, 0), strict=True):
            path.write_bytes(b"".join(_kept_lines(path, rows)))

    def read_metrics(self) -> list[dict[str, Any]]:
        return [row for _, row in read_jsonl(self.metrics_path)]

    def rows(self, name: str) -> int:
        path = self.dir / name
        return len(path.read_bytes().splitlines()) if path.is_file() else 0

    def step(self, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("ab") as f:
            f.write(jsonl([metrics]))

    def samples(self, rows: Iterable[dict[str, Any]]) -> int:
        rows = list(rows)
        with self.samples_path.open("ab") as f:
            f.write(jsonl(rows))
        return len(rows)

    def write_jsonl(self, name: str, rows: list[dict[str, Any]]) -> Path:
        path = self.dir / name
        path.write_bytes(jsonl(rows))
        return path

    @staticmethod
    def rewrite_json(path: Path, data: dict[str, Any]) -> None:
        path.write_bytes(orjson.dumps(data, default=_plain, option=_OPTIONS | orjson.OPT_INDENT_2) + b"\n")

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.dir / name
        path.write_bytes(orjson.dumps(data, default=_plain, option=_OPTIONS | orjson.OPT_INDENT_2) + b"\n")
        return path

    def write_events(
        self,
        slices: list[Slice],
        title: str = "",
        instances: dict[int, int] | None = None,
        metrics: list[dict[str, Any]] | None = None,
    ) -> None:
        """The run's slices as events, a trace and a timeline; ``instances``: each device's instance, where
        instances are of several devices (the trace and the timeline name them); ``metrics``: the steps' rows,
        whose spans (overlapping steps' ``at_s``) the trace and the timeline draw apart from the devices'."""
        # asdict's fields without its deep copy: a simulated run has 10^5 slices
        rows = [dict(device=s.device, role=s.role, name=s.name, start=s.start, end=s.end, args=s.args) for s in slices]
        self.write_jsonl("events.jsonl", rows)
        steps = step_spans(metrics or [])
        write_trace(slices, self.dir / "trace.json", instances, steps)
        draw_timeline(slices, self.dir / "timeline.png", title, instances, steps)


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """A run file's rows (``metrics.jsonl``, ``samples.jsonl``, ``events.jsonl``) as (line number, object), blank
    lines skipped; a line that is not a JSON object is a :class:`UserError` naming the file and the line (a file
    cut short or edited by hand)."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {n}: not JSON ({e.msg}: column {e.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append((n, row))
    return rows


def read_events(run_dir: str | Path) -> list[Slice]:
    """The slices of a run's ``events.jsonl``; a line that is not one is a :class:`UserError` naming the file
    and the line (a file cut short or edited by hand)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no events.jsonl (is it a pivotrl run directory?)")
    slices = []
    for n, row in read_jsonl(path):
        try:
            slices.append(Slice(**row))
        except TypeError:
            raise UserError(f"{path} line {n}: not an event's fields; the file is damaged") from None
    return slices


STEP_PHASES = (
    ("rollout", "start", "rollout_end"),
    ("judge", "rollout_end", "judge_end"),
    ("train", "judge_end", "end"),
)
STEPS_PID = 1 << 20  # the trace's process of the steps' spans (apart from any instance's)


@dataclass(slots=True, frozen=True)
class StepSpan:
    """One step's life on the run's clock (overlapping steps): its begin, the end of its rollout and of its
    judging, its update; ``lane``: the row it is drawn on, apart from the steps beside it."""

    step: int
    lane: int
    start: float
    rollout_end: float
    judge_end: float
    end: float

    def phases(self) -> list[tuple[str, float, float]]:
        """(role, begin, end) of its rollout, of its judging after the rollout ended, and of its training."""
        return [(role, getattr(self, a), getattr(self, b)) for role, a, b in STEP_PHASES]


def step_spans(metrics: list[dict[str, Any]]) -> list[StepSpan]:
    """The spans of the steps whose rows carry them (overlapping steps'), each on the first lane free at its
    begin."""
    spans: list[StepSpan] = []
    free_at: list[float] = []  # lane -> when its last step ended
    for m in sorted((m for m in metrics if "at_s" in m), key=lambda m: m["at_s"]["start"]):
        at = m["at_s"]
        end = at["end"]
        rollout = end if at.get("rollout_end") is None else at["rollout_end"]
        judge = max(rollout, rollout if at.get("judge_end") is None else at["judge_end"])
        lane = next((i for i, t in enumerate(free_at) if t <= at["start"]), len(free_at))
        free_at[lane : lane + 1] = [end]
        spans.append(StepSpan(m["step"], lane, at["start"], rollout, judge, end))
    return spans


def write_trace(
    slices: Iterable[Slice],
    path: str | Path,
    instances: dict[int, int] | None = None,
    steps: list[StepSpan] | None = None,
) -> None:
    """Chrome trace-event JSON: a complete event ("X") per slice, a thread per device; with instances of several
    devices (``instances``: each device's), a process per instance holding its devices' threads; overlapping
    steps' spans (``steps``) in a process of their own, a thread per lane, an event per phase of each step."""
    slices = list(slices)
    pid = (lambda d: instances.get(d, -1)) if instances else (lambda d: 0)
    events: list[dict[str, Any]] = []
    for p in sorted({pid(s.device) for s in slices}) or [0]:
        name = f"instance {p}" if instances else "pivotrl"
        events.append({"ph": "M", "pid": p, "name": "process_name", "args": {"name": name}})
    for d in sorted({s.device for s in slices}):
        events.append({"ph": "M", "pid": pid(d), "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
    for s in slices:
        events.append(
            {
                "ph": "X",
                "pid": pid(s.device),
                "tid": s.device,
                "name": s.name,
                "cat": s.role,
                "ts": round(s.start * 1e6, 3),
                "dur": round(max(0.0, s.end - s.start) * 1e6, 3),
                "args": {"role": s.role, **s.args},
            }
        )
    if steps:
        events.append({"ph": "M", "pid": STEPS_PID, "name": "process_name", "args": {"name": "steps"}})
        for lane in sorted({s.lane for s in steps}):
            name = {"name": f"steps, lane {lane}"}
            events.append({"ph": "M", "pid": STEPS_PID, "tid": lane, "name": "thread_name", "args": name})
        for s in steps:
            for role, a, b in s.phases():
                events.append({"ph": "X", "pid": STEPS_PID, "tid": s.lane, "name": f"step {s.step} {role}",
                               "cat": role, "ts": round(a * 1e6, 3), "dur": round(max(0.0, b - a) * 1e6, 3),
                               "args": {"step": s.step, "phase": role}})  # fmt: skip
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    # (an infinite or NaN argument is written as null: JSON has no such numbers)
    Path(path).write_bytes(orjson.dumps(trace, default=_plain, option=_OPTIONS))


def draw_timeline(
    slices: Iterable[Slice],
    path: str | Path,
    title: str = "",
    instances: dict[int, int] | None = None,
    steps: list[StepSpan] | None = None,
) -> None:
    """Devices x time, coloured by role, in the format ``path``'s suffix names (:data:`PICTURE_FORMATS`). Up to
    ``BAR_ROWS`` devices, one bar per slice (one collection of bars per role); past that, a row of pixels per
    device, painted slice by slice (shifts and migrations last, so that they show), which a thousand devices and
    10^5 slices draw in about a second. Overlapping steps (``steps``) get lanes above the devices: each step's
    rollout, judging after it and training, in the roles' colours, its number written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    slices = list(slices)
    devices = sorted({s.device for s in slices}) or [0]
    end = max((s.end for s in slices), default=1.0)
    begin = min((s.start for s in slices), default=0.0) if slices and min(s.start for s in slices) > 0.2 * end else 0.0
    row = 0.55 if len(devices) <= 32 else max(0.02, 17.6 / len(devices))  # at most ~20 inches of rows
    fig, ax = plt.subplots(figsize=(12, 1.6 + row * len(devices)))
    if len(devices) <= BAR_ROWS:
        roles = _bars(ax, slices, begin, end)
    else:
        roles = _raster(ax, slices, devices, begin, end)
    every = max(1, math.ceil(len(devices) / 32))  # label at most ~32 rows
    label = (lambda d: f"instance {instances.get(d)} device {d}") if instances else (lambda d: f"device {d}")
    ticks, names = devices[::every], [label(d) for d in devices[::every]]
    top = min(devices) - 0.6
    if steps:
        lanes = 1 + max(s.lane for s in steps)
        height = max(1.0, len(devices) / 16)  # a lane's height in device rows (a big cluster's rows are thin)
        first = min(devices) - 1 - height * lanes  # lanes above the devices, lane 0 on top
        _step_lanes(ax, steps, first, height)
        ticks = [first + height * (i + 0.5) for i in range(lanes)] + ticks
        names = [f"steps, lane {i}" for i in range(lanes)] + names
        top = first - 0.1
    ax.set_yticks(ticks, names)
    ax.set_ylim(top, max(devices) + 0.6)
    ax.invert_yaxis()
    ax.set_xlim(begin, end)
    ax.set_xlabel("seconds since start")
    shown = [r for r in ROLE_COLORS if r in roles]
    handles = [Patch(color=ROLE_COLORS[r], label=r) for r in shown]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(shown) or 1, frameon=False)
    if title:
        ax.set_title(title, loc="left")
    if len(devices) <= BAR_ROWS:
        fig.tight_layout()
    else:  # fixed margins: tight_layout would draw the big figure once more to measure it
        width, height = fig.get_size_inches()
        fig.subplots_adjust(left=1.0 / width, right=1 - 0.2 / width, bottom=0.6 / height, top=1 - 0.6 / height)
    png = Path(path).suffix.lower() == ".png"  # a fast deflate there: the file is a few 100 kB more
    fig.savefig(path, dpi=110, **({"pil_kwargs": {"compress_level": 1}} if png else {}))
    plt.close(fig)


PICTURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")  # a timeline's, by suffix
BAR_ROWS = 64  # more devices than this are drawn as pixel rows (a bar would be under 3 pixels high)
RASTER_COLUMNS = 2000  # time bins of the pixel rows: more than the figure has pixels across


def _step_lanes(ax: Any, steps: list[StepSpan], first: float, height: float) -> None:
    """Each step's phases as bars on its lane (lane i from ``first + i * height``), the step's number on it."""
    from matplotlib.collections import PolyCollection

    for role, *_ in STEP_PHASES:
        verts = []
        for s in steps:
            y0, y1 = first + height * (s.lane + 0.1), first + height * (s.lane + 0.9)
            verts += [[(a, y0), (b, y0), (b, y1), (a, y1)] for r, a, b in s.phases() if r == role and b > a]
        ax.add_collection(PolyCollection(verts, facecolors=ROLE_COLORS[role], edgecolors="none", alpha=0.6),
                          autolim=False)  # fmt: skip
    for s in steps:
        ax.text(s.start, first + height * (s.lane + 0.5), f" {s.step}", va="center", ha="left", fontsize=7)


def _bars(ax: Any, slices: list[Slice], begin: float, end: float) -> set[str]:
    """A bar per slice; bars of one role closer than a pixel are drawn as one."""
    from matplotlib.collections import PolyCollection

    bars: dict[str, list] = {}
    merge = (end - begin) / 4000
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
    return set(bars)


def _raster(ax: Any, slices: list[Slice], devices: list[int], begin: float, end: float) -> set[str]:
    """One row of pixels per device from ``devices[0]`` to ``devices[-1]``, ``RASTER_COLUMNS`` time bins;
    a bin shows the role of the last slice painted over it (idle: white)."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    names = list(ROLE_COLORS) + sorted({s.role for s in slices} - set(ROLE_COLORS))
    index = {r: i + 1 for i, r in enumerate(names)}
    first, width = devices[0], max(end - begin, 1e-9) / RASTER_COLUMNS
    image = np.zeros((devices[-1] - first + 1, RASTER_COLUMNS), dtype=np.uint8)
    on_top = ("shift", "migrate")  # short and telling: painted over the work around them
    row = np.array([s.device - first for s in slices], dtype=np.int64)
    start = np.array([s.start for s in slices])
    stop = np.array([s.end for s in slices])
    value = np.array([index[s.role] for s in slices], dtype=np.uint8)
    order = np.lexsort((start, [s.role in on_top for s in slices]))  # painting order: by start, on-top ones last
    row, start, stop, value = row[order], start[order], stop[order], value[order]
    b0 = np.clip(((start - begin) / width).astype(np.int64), 0, RASTER_COLUMNS - 1)
    b1 = np.maximum(b0 + 1, np.minimum(RASTER_COLUMNS, np.ceil((stop - begin) / width).astype(np.int64)))
    span = b1 - b0  # every bin of every slice, in painting order
    owner = np.repeat(np.arange(len(span)), span)
    bins = b0[owner] + np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
    cells = (row[owner] * RASTER_COLUMNS + bins)[::-1]
    cells, last = np.unique(cells, return_index=True)  # the first seen backwards: the last painted
    image.flat[cells] = value[owner[::-1][last]]
    colors = ["#ffffff"] + [ROLE_COLORS.get(r, "#999999") for r in names]
    extent = (begin, end, devices[-1] + 0.5, first - 0.5)
    ax.imshow(image, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto",
              interpolation="nearest", extent=extent, origin="upper")  # fmt: skip
    return {s.role for s in slices}
