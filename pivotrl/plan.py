"""``pivotrl plan``: the planner's view of a job before running it.

It builds the workload of one whole step from the config (and, given a
finished run, the lengths and throughputs that run measured), estimates the
step for every split of the devices, and prints the recommended start split
with its expected timeline. Pure logic, no devices touched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivotrl.config import JobConfig
from pivotrl.control.messages import ROLES, Role
from pivotrl.control.planner import Profiles, Workload, estimate, fmt_alloc, initial_split
from pivotrl.control.shiftable import Shiftable


def measured(run_dir: Path) -> dict[str, float]:
    """Means and per-role throughputs of a finished run (metrics.jsonl + events.jsonl)."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not metrics:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps")
    n = sum(m["response_tokens"] / m["response_length"] for m in metrics if m["response_length"])
    out = {
        "response_tokens": sum(m["response_tokens"] for m in metrics) / max(n, 1),
        "judge_tokens": sum(m["judge_tokens"] for m in metrics) / max(n, 1),
        "step_seconds": sum(m["time_s"]["train"] for m in metrics) / len(metrics),
    }
    busy: dict[str, float] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        busy[e["role"]] = busy.get(e["role"], 0.0) + e["end"] - e["start"]
    tokens = {"rollout": sum(m["response_tokens"] for m in metrics), "genrm": sum(m["judge_tokens"] for m in metrics)}
    for role, t in tokens.items():
        if busy.get(role):
            out[f"{role}_rate"] = t / busy[role]
    return out


def plan_report(cfg: JobConfig, run_dir: Path | None = None, top: int = 5) -> dict[str, Any]:
    policy = Shiftable(cfg.devices, cfg.rollout.max_batch, cfg.rollout.max_new_tokens, cfg.judge.max_new_tokens)
    profiles: Profiles = policy.profiles
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    resp, judge, step_s = cfg.rollout.max_new_tokens / 2, cfg.judge.max_new_tokens / 2, 0.1
    source = "priors"
    if run_dir is not None:
        m = measured(run_dir)
        resp, judge, step_s, source = m["response_tokens"], m["judge_tokens"], m["step_seconds"], str(run_dir)
        for _ in range(64):
            profiles.lengths.observe(max(1, round(resp)))
        if "rollout_rate" in m:
            profiles.rollout.observe(round(m["rollout_rate"]), 1.0, cfg.rollout.max_batch)
        if "genrm_rate" in m:
            profiles.judge.observe(round(m["genrm_rate"]), 1.0, cfg.rollout.max_batch)
    work = Workload(
        rollout_remaining=[0] * seqs,
        judge_future=seqs,
        judge_tokens_mean=judge,
        train_groups_left=cfg.rollout.prompts_per_step,
        train_tokens_per_group=resp * cfg.rollout.group_size,
        step_seconds=step_s,
    )
    best = initial_split(work, profiles, cfg.devices, cfg.rollout.max_batch)
    rows = []
    for r in range(cfg.devices + 1):
        for g in range(cfg.devices + 1 - r):
            alloc = {Role.ROLLOUT: r, Role.GENRM: g, Role.TRAIN: cfg.devices - r - g}
            rows.append(estimate(work, profiles, alloc, cfg.rollout.max_batch))
    rows.sort(key=lambda e: e.total)
    return {
        "devices": cfg.devices,
        "source": source,
        "recommended": {r.value: best[r] for r in ROLES},
        "estimates": [{"split": fmt_alloc(e.alloc), "timeline": e.describe(), "seconds": e.total} for e in rows[:top]],
    }


def format_report(report: dict[str, Any]) -> str:
    rec = report["recommended"]
    lines = [
        f"devices: {report['devices']}   profile: {report['source']}",
        "recommended start split: " + ", ".join(f"{k}:{v}" for k, v in rec.items()),
        "expected step (best splits, phases end at):",
    ]
    lines += [f"  {e['timeline']}" for e in report["estimates"]]
    return "\n".join(lines)
