"""A simulated run's steady numbers: its throughput, step time, busy shares and shifts after its first step.

The first step runs on the planner's priors and pays every device's first load, so a mode is compared by the
steps after it. The window of busy time, shifts and moves is the same: from the end of step 1's optimizer step
to the end of the last step's (a run of one step: from 0). Every comparison of modes (``pivotrl simulate
--versus``, the model-group benchmarks) reads a run through this one function.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivotrl.control import messages

ROLES = tuple(r.value for r in messages.ROLES)


def steady_window(run_dir: str | Path) -> dict[str, Any]:
    """Throughput, step time, busy fractions and shifts over the steps after the first, from a run directory's
    ``summary.json``, ``metrics.jsonl`` and ``events.jsonl``."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics  # the window of summary.json's steady_samples_per_s
    step_s = sum(m["step_seconds"] for m in later) / len(later)
    rollout_s = sum(m["time_s"]["rollout"] for m in later) / len(later)  # from a step's start to its last response
    spans = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    ends: dict[int, float] = {}  # step -> end of its optimizer step
    for s in spans:
        if s["role"] == "train" and s["name"].startswith("step v"):
            v = int(s["name"].rsplit("v", 1)[1])
            ends[v] = max(ends.get(v, 0.0), s["end"])
    w0, w1 = (ends[1], ends[len(metrics)]) if len(metrics) > 1 else (0.0, ends[len(metrics)])
    busy = dict.fromkeys((*ROLES, "shift"), 0.0)
    moves = 0
    for s in spans:
        seconds = min(s["end"], w1) - max(s["start"], w0)
        if s["role"] in busy and seconds > 0:
            busy[s["role"]] += seconds
        src, _, dst = s["name"].partition("->")
        if s["role"] == "shift" and w0 <= s["start"] < w1 and src not in (dst, "none"):
            moves += 1
    capacity = summary["devices"] * (w1 - w0)
    fractions = {r: b / capacity for r, b in busy.items()} if capacity > 0 else busy
    # from a group's last response to its last judgment: how long its backward waits on the judge
    waits = [m["group_wait_s"] for m in later if m.get("group_wait_s")]
    wait = {k: sum(x[k] for x in waits) / len(waits) for k in ("median", "p90", "max")} if waits else None
    return {
        "samples_per_s": summary["steady_samples_per_s"],
        "train_backend": summary.get("train_backend"),  # (the trainer the run priced)
        "step_seconds": step_s,
        "step_seconds_each": [m["step_seconds"] for m in metrics],
        "rollout_seconds": rollout_s,
        "busy_fraction": fractions,
        "idle_fraction": max(0.0, 1 - sum(fractions.values())),
        "shifts_per_step": sum(m["shifts"] for m in later) / len(later),  # role moves and weight reloads
        "moves_per_step": moves / max(len(later), 1),  # devices changing role
        "shift_seconds_per_step": sum(m["shift_seconds"] for m in later) / len(later),  # device-seconds
        "migrations_per_step": sum(m["migrations"] for m in later) / len(later),
        "group_wait_s": wait,  # (the steps' median, 90th percentile and longest, averaged over the steps)
    }
