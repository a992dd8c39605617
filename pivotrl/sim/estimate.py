"""How far ahead the shiftable planner sees: every plan's estimate of a step's end, against the end that came.

Every plan estimates when the rollout ends and when the step completes with the allocation it picks; the
planner's decisions are only as good as those estimates. ``recorded_run`` simulates a job with
``Planner.plan`` wrapped to note each estimate (put back after, whatever happens); ``errors`` reads, for each
step after the first, the plans nearest a quarter, half and three quarters of its rollout against the
rollout's and the step's real ends. ``benchmarks/estimate.py`` runs it on the model groups.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pivotrl.config import load_config
from pivotrl.control import planner as planner_module
from pivotrl.sim.run import run_simulation

AT = (0.25, 0.5, 0.75)  # points of a step's rollout at which a plan's estimate is read


def recorded_run(config: str | Path, overrides: list[str]) -> tuple[list[tuple[float, float, float]], list[dict]]:
    """One simulated run of the job ``config`` with ``overrides``: every plan's (time, expected rollout end,
    expected step end), and its steps."""
    plans: list[tuple[float, float, float]] = []
    original = planner_module.Planner.plan

    def plan(self, now, *args, **kwargs):  # type: ignore[no-untyped-def]
        decision = original(self, now, *args, **kwargs)
        est = decision.after or decision.before
        if est is not None and est.total < float("inf"):
            plans.append((now, now + est.rollout_end, now + est.total))
        return decision

    planner_module.Planner.plan = plan  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as out:
            run_simulation(load_config(config, overrides, simulated=True), out)
            steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    finally:
        planner_module.Planner.plan = original  # type: ignore[method-assign]
    return plans, steps


def errors(plans: list[tuple[float, float, float]], steps: list[dict]) -> dict[float, list[tuple[float, float]]]:
    """Per point of the rollout, (rollout end, step end) errors of the plan nearest it, steps 2 onwards
    (steps run back to back: a step starts where the one before ended)."""
    out: dict[float, list[tuple[float, float]]] = {at: [] for at in AT}
    start = 0.0
    for i, m in enumerate(steps):
        rollout, step = m["time_s"]["rollout"], m["step_seconds"]
        inside = [p for p in plans if start <= p[0] < start + rollout]
        for at in AT if i and inside else ():
            now, r_end, s_end = min(inside, key=lambda p: abs(p[0] - (start + at * rollout)))
            out[at].append((r_end - (start + rollout), s_end - (start + step)))
        start += step
    return out
