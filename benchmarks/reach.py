"""What a schedule could reach: the joint floor's own rollout, replayed with a judge that pays for its latency.

The joint floor (``pivotrl.sim.ideal``) is a bound, not a schedule. It prices every judgment at a full
batch's cost, and the judgment that ends a step at a batch of one's latency. A judge does not get both: a
judgment decoded beside 255 others takes several times as long as one decoded alone, and a group trains
only once its last judgment is done. This replays, on a fluid model of the cluster (``pivotrl.sim.reach``),
the rollout the joint floor prices (its instances run by run, ``JointFloor.runs``), each response ending
when that rollout passes its length, with one of two judges:

    floor's judge    every judgment at a full batch's price (the floor's), served first in first out
                     on every instance the rollout leaves free, and done no sooner than a batch-1
                     judgment of its response after the response ends: the floor's own terms, so its
                     step should come out at about the floor (a check of the replay and of the floor)
    batched judge    continuous batches on the instances the rollout leaves free: a judge instance
                     holds at most its capacity, reads each prompt (at a full prefill batch's price)
                     before decoding, and decodes every judgment it holds one token a step, at the step
                     time of its batch and context. The judge takes ceil(judgments held or waiting / b)
                     instances for a target batch b, the rest train; the best b of --targets is kept

Training is fluid in both: a group's backward (its share of the step's by tokens, at the floor's price)
runs on any instance neither rolling out nor judging once its last judgment is done (FSDP2: every group
after the step's last judgment, as the lockstep trainer runs it), then the optimizer step as the floor
prices it. Nothing else costs anything: no shift, no migration, no instance waiting for another, the
lengths known to nobody but replayed from the same quantile grid as the floor. So the batched replay
leaves out everything ``benchmarks/gap.py`` measures, and what it loses against the floor is what a
judge's batch costs in latency or in price. It is a schedule, not a bound: another judge policy might do
better. The lengths are the floor's quantile grids; which response is in which group, and which judgment
length goes with it, are drawn with ``--seed``.

    python benchmarks/reach.py                     # the six groups of paper.py, each at its job file's size
    python benchmarks/reach.py --shiftable-steps 8  # and beside each, shiftable simulated at that size
    python benchmarks/reach.py --groups dense-7b --targets 16 32 64
    python benchmarks/reach.py --groups dense-14b moe-30b --cohort 8 --out /tmp/reach_cohort.json

``--cohort K`` is a what-if for the FSDP2 groups, a trainer pivotrl does not run yet: K instances form a
train group once the first group is judged and as many are free, backpropagate in lockstep the groups
judged so far and keep the train role to the step; the others join at the last judgment, after the group
meets again (the cost model's regroup).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import machine, write_report

from pivotrl.sim.groups import GROUPS, job_overrides
from pivotrl.sim.reach import DT, TARGETS, reach
from pivotrl.sim.versus import simulate_apart

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--tp", type=int, default=0, help="GPUs per instance (0: the group's job file's)")
    ap.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), help="the judge's target batches")
    ap.add_argument("--seed", type=int, default=0, help="draws which response is in which group, and its judgment")
    ap.add_argument("--cohort", type=int, default=0, metavar="K",
                    help="what-if for FSDP2 groups: K instances backpropagate as groups are judged, the rest join at "
                         "the last judgment after a regroup (not a trainer pivotrl has)")  # fmt: skip
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="further overrides of every job")
    ap.add_argument("--shiftable-steps", type=int, default=0, metavar="N",
                    help="also simulate shiftable for N steps at each group's size and compare its steady step "
                         "(0: not)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1800.0, help="wall seconds the shiftable run may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "reach.json")
    args = ap.parse_args(argv)
    if min(args.targets) < 1:
        ap.error(f"--targets: batches of at least 1, got {min(args.targets)}")
    if args.cohort < 0:
        ap.error(f"--cohort: instances, 0 (none) or more, got {args.cohort}")
    if args.shiftable_steps and args.shiftable_steps < 2:
        ap.error(f"--shiftable-steps: 0 (none) or at least 2 (the first is left out), got {args.shiftable_steps}")
    load, t0 = list(os.getloadavg()), time.perf_counter()
    rows = []
    head = (f"{'group':16s} {'tp':>2s} {'floor':>7s} {'floor judge':>11s} {'batched':>8s} {'b':>4s} "
            f"{'floor/batched':>13s} {'shiftable':>9s} {'shiftable/batched':>17s}")  # fmt: skip
    print(head)
    for name in args.groups:
        group = GROUPS[name]
        tp = args.tp or group.instance_gpus
        overrides = job_overrides(group, args.gpus, tp)
        cfg = group.job([*overrides, "mode=colocated", *args.set])
        row = {"name": name, "instance_gpus": tp, **reach(cfg, tuple(args.targets), args.seed, cohort=args.cohort)}
        shiftable = None
        if args.shiftable_steps and not args.cohort:  # (a cohort is a what-if no run has)
            run = simulate_apart(group.config, [*overrides, *args.set, "mode=shiftable",
                                                   f"steps={args.shiftable_steps}"], args.timeout)  # fmt: skip
            shiftable = run.get("step_seconds")
        row["shiftable_seconds"] = shiftable
        rows.append(row)
        best, floor = row["best_seconds"], row["floor_seconds"]
        tail = f"{shiftable:8.1f}s {100 * best / shiftable:16.0f}%" if shiftable else f"{'-':>9s} {'-':>17s}"
        print(f"{name:16s} {tp:2d} {floor:6.1f}s {row['floors_judge']['seconds']:10.1f}s {best:7.1f}s "
              f"{row['best_target']:4d} {100 * floor / best:12.0f}% {tail}", flush=True)  # fmt: skip
    print("(steady step seconds; floor judge: the replay on the floor's own terms; batched: its best target batch b;"
          " shiftable: its simulated run at that size, with --shiftable-steps)")  # fmt: skip
    report = {"machine": machine(load), "gpus": args.gpus, "targets": args.targets, "seed": args.seed,
              "cohort": args.cohort, "set": args.set, "dt": DT, "wall_s": time.perf_counter() - t0,
              "groups": rows}  # fmt: skip
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
