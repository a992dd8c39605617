"""How far ahead the shiftable planner sees: its estimate of a step's end against the end that came.

Every plan estimates when the rollout ends and when the step completes with the allocation it
picks; the planner's decisions are only as good as those estimates. This runs each model group of
``paper.py`` in shiftable mode at 128 H100s, records every plan's estimate (``Planner.plan`` wrapped in
this process), and for the steady steps compares the plans made at a quarter, half and three quarters
of the rollout with what happened: the rollout's end and the step's end, in seconds (negative: the
plan expected them sooner).

    python benchmarks/estimate.py [--groups judge-32b] [--steps 6] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

from common import machine, write_report
from paper import EXAMPLE, GROUPS, RESULTS, ROOT, instance_sizes, job_overrides

from pivotrl.config import load_config
from pivotrl.control import planner as planner_module
from pivotrl.sim.run import run_simulation

AT = (0.25, 0.5, 0.75)  # points of a step's rollout at which a plan's estimate is read


def recorded_run(overrides: list[str]) -> tuple[list[tuple[float, float, float]], list[dict]]:
    """One simulated run: every plan's (time, expected rollout end, expected step end), and its steps."""
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
            run_simulation(load_config(EXAMPLE, overrides), out)
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


def shiftable_size(name: str) -> int:
    """The instance size ``paper.py`` ran the group's shiftable mode at (its report in benchmarks/results);
    without one, the size with the highest ideal throughput."""
    try:
        for g in json.loads((RESULTS / "paper.json").read_text())["groups"]:
            if g["name"] == name:
                return int(g["modes"]["shiftable"].get("instance_gpus", g["instance_gpus"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sizes = instance_sizes(GROUPS[name], 128)
    return max(sizes, key=lambda tp: sizes[tp].samples_per_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tp", type=int, help="GPUs per instance (default: shiftable's in paper.json)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/estimate.json")
    args = p.parse_args()
    load = list(os.getloadavg())
    rows, t0 = [], time.perf_counter()
    print(f"{'group':<10} {'at':>5} {'rollout end s':>15} {'|err|':>6} {'step end s':>12} {'|err|':>6} {'steps':>6}")
    for name in args.groups:
        tp = args.tp or shiftable_size(name)
        found: dict[float, list[tuple[float, float]]] = {at: [] for at in AT}
        for seed in args.seeds:
            overrides = [*job_overrides(GROUPS[name], 128, tp), "mode=shiftable", f"steps={args.steps}", f"seed={seed}"]
            for at, errs in errors(*recorded_run(overrides)).items():
                found[at] += errs
        for at in AT:
            r, s = [e[0] for e in found[at]], [e[1] for e in found[at]]
            row = {"group": name, "instance_gpus": tp, "at": at, "steps": len(s), "rollout_end_error_s": mean(r),
                   "rollout_end_abs_s": mean(map(abs, r)), "step_end_error_s": mean(s),
                   "step_end_abs_s": mean(map(abs, s)), "step_end_errors_s": s}  # fmt: skip
            rows.append(row)
            print(f"{name:<10} {at:>5.2f} {row['rollout_end_error_s']:>+15.1f} {row['rollout_end_abs_s']:>6.1f} "
                  f"{row['step_end_error_s']:>+12.1f} {row['step_end_abs_s']:>6.1f} {len(s):>6}")  # fmt: skip
    write_report(args.out, {"steps": args.steps, "seeds": args.seeds, "at": list(AT), "rows": rows,
                            "wall_s": time.perf_counter() - t0, "machine": machine(load)})  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
