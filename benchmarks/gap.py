"""Where shiftable's gap to the step floor goes: role changes, migrations, and the schedule itself.

For each of ``paper.py``'s model groups (128 simulated H100s, ``examples/paper/*.yaml``), shiftable
runs four times on the same seeds, each in its own process:

    modeled          the costs as ``RooflineCosts`` models them
    free shifts      every role change at no cost (``sim.shift_scale=0``)
    free migrations  every migrated sequence resumed at no cost (``sim.migration_scale=0``)
    both free        both

The joint floor (``pivotrl.sim.ideal``) prices neither, so the steps of "both free" against it
are what the schedule alone leaves, and the differences between the rows what role changes and
migrations take. A what-if's planner measures the free shifts as it goes but still prices a
migration at its re-prefill, so "free migrations" is what they take at least.

Steady step = the mean of the steps after the first; ``--seeds`` repeats every run on more seeds
(the table gives their mean, the JSON each). Instances of ``--tp`` GPUs, by default the size
the group's job file names (the one shiftable runs fastest at).

    python benchmarks/gap.py                        # six groups, one seed: ~3.5 min on 2 cores (three: ~10)
    python benchmarks/gap.py --groups dense-7b --seeds 0 1 2
    python benchmarks/gap.py --variants modeled --set train.backend=fsdp --out /tmp/gap_fsdp.json  # FSDP2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import machine, write_report

from pivotrl.sim.groups import GROUPS, ideal, job_overrides
from pivotrl.sim.versus import simulate_apart

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"

VARIANTS = {
    "modeled": (),
    "free shifts": ("sim.shift_scale=0",),
    "free migrations": ("sim.migration_scale=0",),
    "both free": ("sim.shift_scale=0", "sim.migration_scale=0"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--tp", type=int, default=0, help="GPUs per instance (0: the group's job file's)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at once")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="further overrides of every run")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="the rows to run")
    ap.add_argument("--out", type=Path, default=RESULTS / "gap.json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (the first step is left out of the steady step)")
    load, t0 = list(os.getloadavg()), time.perf_counter()
    tp = {name: args.tp or GROUPS[name].instance_gpus for name in args.groups}
    plan = []  # (group, variant, seed, overrides)
    for name in args.groups:
        base = [*job_overrides(GROUPS[name], args.gpus, tp[name]), "mode=shiftable", f"steps={args.steps}", *args.set]
        for variant in args.variants:
            for seed in args.seeds:
                plan.append((name, variant, seed, [*base, f"seed={seed}", *VARIANTS[variant]]))
    done = [0]

    def run(item: tuple[str, str, int, list[str]]) -> dict[str, Any]:
        row = simulate_apart(GROUPS[item[0]].config, item[3], args.timeout)  # (the steady numbers or the error)
        done[0] += 1  # (the pool's threads only add: a lost count would only misprint the progress)
        what = f"{row['step_seconds']:.1f} s a step" if "step_seconds" in row else row["error"]
        print(f"gap: {done[0]}/{len(plan)} {item[0]}, {item[1]}, seed {item[2]}: {what} ({row['wall_s']:.0f} s)",
              flush=True)  # fmt: skip
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # (each run is its own process)
        rows = list(pool.map(run, plan))
    groups = {name: {"name": name, "instance_gpus": tp[name], "variants": {v: {"runs": {}} for v in args.variants}}
              for name in args.groups}  # fmt: skip
    for (name, variant, seed, _), row in zip(plan, rows, strict=True):
        groups[name]["variants"][variant]["runs"][str(seed)] = row
    failed = [(n, v, s, r["error"]) for (n, v, s, _), r in zip(plan, rows, strict=True) if "error" in r]
    header = f"{'group':16s} {'floor':>7s}" + "".join(f" {v:>17s}" for v in args.variants)
    print(header)
    for name, g in groups.items():
        group = GROUPS[name]
        floor = ideal(group.config, [*job_overrides(group, args.gpus, g["instance_gpus"]), *args.set]).floor_seconds
        g["floor_seconds"] = floor
        line = f"{name:16s} {floor:6.1f}s"
        for v in g["variants"].values():
            steps = [r["step_seconds"] for r in v["runs"].values() if "step_seconds" in r]
            v["mean_step_seconds"] = m = sum(steps) / len(steps) if steps else None
            v["floor_fraction"] = floor / m if m else None
            line += f" {m:7.1f}s ({100 * floor / m:3.0f}%)" if m else f" {'failed':>17s}"
        print(line)
    print("(steady step seconds, and the floor's share of them: its throughput against the run's)")
    for n, v, s, e in failed:
        print(f"{n} {v} seed {s}: {e}", file=sys.stderr)
    report = {"machine": machine(load), "gpus": args.gpus, "steps": args.steps, "seeds": args.seeds, "set": args.set,
              "wall_s": time.perf_counter() - t0, "groups": list(groups.values())}  # fmt: skip
    write_report(args.out, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
