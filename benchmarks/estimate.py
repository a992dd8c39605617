"""How far ahead the shiftable planner sees: its estimate of a step's end against the end that came.

Every plan estimates when the rollout ends and when the step completes with the allocation it
picks; the planner's decisions are only as good as those estimates. This runs each model group of
``paper.py`` (``examples/paper/*.yaml``) in shiftable mode at 128 H100s, records every plan's estimate
(``Planner.plan`` wrapped in this process: ``pivotrl.sim.estimate``), and for the steady steps compares the
plans made at a quarter, half and three quarters of the rollout with what happened: the rollout's end and
the step's end, in seconds (negative: the plan expected them sooner).

    python benchmarks/estimate.py [--groups judge-32b] [--steps 6] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import mean

from common import machine, write_report

from pivotrl.sim.estimate import AT, errors, recorded_run
from pivotrl.sim.groups import GROUPS, job_overrides

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tp", type=int, help="GPUs per instance (default: the group's job file's)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/estimate.json")
    args = p.parse_args()
    load = list(os.getloadavg())
    rows, t0 = [], time.perf_counter()
    print(f"{'group':<10} {'at':>5} {'rollout end s':>15} {'|err|':>6} {'step end s':>12} {'|err|':>6} {'steps':>6}")
    for name in args.groups:
        group = GROUPS[name]
        tp = args.tp or group.instance_gpus
        found: dict[float, list[tuple[float, float]]] = {at: [] for at in AT}
        for seed in args.seeds:
            overrides = [*job_overrides(group, 128, tp), "mode=shiftable", f"steps={args.steps}", f"seed={seed}"]
            for at, errs in errors(*recorded_run(group.config, overrides)).items():
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
