"""Engines inside an instance: does a per-role engine size, or elastic tensor parallelism, change the comparison?

``paper.py`` runs every instance as one engine a role, at the instance size where each mode is fastest: the
layouts the runtime builds. Two things that could change its table are left out there, as no runtime layout
today (what-ifs), and measured here on its model groups
(128 simulated H100s, 512 x 16 samples a step), every mode beside the others in one run:

* **Per-role engines** (``sim.rollout_engine_gpus``, ``sim.judge_engine_gpus``): an instance of 4 GPUs
  may roll out on 2 engines of 2 and judge on one of 4, as a deployment with its own tensor-parallel
  size per model would. Colocated runs every pair of engine sizes that divides its instance and holds
  the models; shiftable the pairs one halving away from one engine; the disaggregated split is searched
  (as in ``paper.py``, ``--search-budget`` runs each) at one engine of 2 and of 4 GPUs and at the two
  mixed layouts of 4.
* **The elastic bound** (``sim.elastic_engines``): every decode span on the layout that makes it
  shortest, from the smallest engines that hold the model up to one engine of the instance, changed
  for free. No engine does this; it is what elastic tensor parallelism inside an instance could give
  at most, in every mode (the split at the splits searched for one engine of 2 and of ``--tp`` GPUs).

The question is whether the baselines were held back (a layout makes colocated or the split faster
than ``paper.py``'s best) and whether a mechanism beside shifting could reach the reference's ratios.
The layouts and the reading of their runs are ``pivotrl.sim.engine_layouts``. Each row is the mode's best
layout found and its gain over its best run of one engine an instance.

    python benchmarks/layouts.py [--groups dense-7b] [--steps 6] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import machine, write_report

from pivotrl.config import load_config
from pivotrl.sim.engine_layouts import HEAD, Layout, divisors, label, overrides, rows, summarize
from pivotrl.sim.groupreport import text_table
from pivotrl.sim.groups import BASE, GROUPS, Group
from pivotrl.sim.versus import search_split, simulate_apart, split_text

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"


def bench(group: Group, gpus: int, args: argparse.Namespace, pool: ThreadPoolExecutor) -> dict[str, Any]:
    t0 = time.perf_counter()
    steps = [f"steps={args.steps}"]

    def run(mode: str, layout: Layout, elastic: bool = False, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        r = simulate_apart(group.config, [*overrides(group, gpus, layout, elastic), f"mode={mode}", *steps, *extra],
                           args.timeout)  # fmt: skip
        r["layout"], r["elastic"] = label(layout, elastic), elastic
        rate = f"{r['samples_per_s']:.2f} samples/s" if "samples_per_s" in r else r["error"].splitlines()[-1][:80]
        print(f"  {group.name} {mode} {r['layout']}{' ' + extra[0] if extra else ''}: {rate}", flush=True)
        return r

    tp = args.tp
    colocated = [(tp, r, j) for r in divisors(tp) for j in divisors(tp)]
    half = tp // 2
    shiftable = [(tp, tp, tp), (tp, half, tp), (tp, tp, half), (tp, half, half)]
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for layout in colocated:
        jobs.append(("colocated", lambda layout=layout: run("colocated", layout)))
    for layout in shiftable:
        jobs.append(("shiftable", lambda layout=layout: run("shiftable", layout)))
    for size in args.elastic_sizes:
        for mode in ("colocated", "shiftable"):
            jobs.append((mode, lambda mode=mode, size=size: run(mode, (size, 0, 0), elastic=True)))

    def split_search(layout: Layout) -> list[dict[str, Any]]:
        devices = gpus // layout[0]

        def evaluate(split: tuple[int, int, int]) -> float:
            r = simulate_apart(group.config, [*overrides(group, gpus, layout), "mode=disaggregated",
                                              f"steps={args.search_steps}", f"split={split_text(split)}"],
                               args.timeout)  # fmt: skip
            return r.get("step_seconds", float("inf")) if "error" not in r else float("inf")

        seed = (devices * 3 // 8, devices // 4, devices - devices * 3 // 8 - devices // 4)
        best, tried = search_split(evaluate, devices, seed, budget=args.search_budget)
        split = f"split={split_text(best)}"
        r = run("disaggregated", layout, extra=(split,))
        r["split"], r["searched"] = split_text(best), len(tried)
        if layout[1] == layout[2] == layout[0]:  # the elastic bound on the split found for one engine that size
            e = run("disaggregated", (layout[0], 0, 0), elastic=True, extra=(split,))
            e["split"] = split_text(best)
            return [r, e]
        return [r]

    splits = [(2, 2, 2), (tp, tp, tp), (tp, half, tp), (tp, tp, half)]
    futures = [(mode, pool.submit(fn)) for mode, fn in jobs]
    futures += [("disaggregated", pool.submit(split_search, layout)) for layout in splits]
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": [], "shiftable": []}
    for mode, f in futures:
        got = f.result()
        runs[mode] += got if isinstance(got, list) else [got]
    return {"name": group.name, "policy": group.policy, "judge": group.genrm, "gpus": gpus, "tp": tp,
            "runs": runs, "wall_s": time.perf_counter() - t0, **summarize(runs)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--tp", type=int, default=4, help="GPUs an instance for the fixed layouts (default 4)")
    p.add_argument("--elastic-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--search-steps", type=int, default=4)
    p.add_argument("--search-budget", type=int, default=12)
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (each its own process)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=RESULTS / "layouts.json")
    args = p.parse_args()
    load = list(os.getloadavg())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        groups = []
        for name in args.groups:
            groups.append(bench(GROUPS[name], args.gpus, args, pool))
            print(text_table(rows(groups[-1]), HEAD), flush=True)
    table = [row for g in groups for row in rows(g)]
    print(text_table(table, HEAD))
    for g in groups:
        print(f"{g['name']}: shiftable {g['speedup_vs_colocated']:.2f}x colocated, "
              f"{g['speedup_vs_disaggregated']:.2f}x the split at their best layouts; with the elastic bound "
              f"{g['elastic_speedup_vs_colocated']:.2f}x, {g['elastic_speedup_vs_disaggregated']:.2f}x")  # fmt: skip
    rollout = load_config(BASE, []).rollout
    report = {"benchmark": "layouts", "steps": args.steps, "groups": groups, "wall_s": time.perf_counter() - t0,
              "samples_per_step": rollout.prompts_per_step * rollout.group_size, "machine": machine(load)}  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
