"""Placement does not change what a job learns: shiftable on N devices against colocated on one.

Runs the default job twice with the same seed — shiftable mode on ``--devices``
Ray devices, and colocated mode on one in-process device — and compares them
sample by sample (``pivotrl compare``): sequences with identical tokens, identical
rewards, and the two held-out accuracy curves. Also prints each run's samples/s,
shifts and migrations. ``--runs A B`` compares two finished run directories
instead of running.

    python benchmarks/semantics.py                 # ~8 min on 2 cores
    python benchmarks/semantics.py --steps 20
    python benchmarks/semantics.py --runs runs/full_shiftable runs/full_colo1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from common import ensure_models, machine, write_report

from pivotrl.compare import compare_runs, format_comparison
from pivotrl.config import load_config
from pivotrl.log import setup_logging
from pivotrl.runtime.job import run_job

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/default.yaml")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="default: the config's")
    p.add_argument("--runs", nargs=2, type=Path, metavar=("A", "B"), help="compare these run directories")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/semantics.json")
    args = p.parse_args()
    setup_logging()
    load_at_start = list(os.getloadavg())
    if args.runs:
        a, b = args.runs
    else:
        ensure_models(args.config)
        base = [] if args.steps is None else [f"steps={args.steps}"]
        a, b = ROOT / "runs/semantics_shiftable", ROOT / "runs/semantics_colocated1"
        for out, extra in ((a, ["mode=shiftable", f"devices={args.devices}"]), (b, ["mode=colocated", "devices=1"])):
            t0 = time.perf_counter()
            run_job(load_config(args.config, [*base, *extra]), out, progress=False)
            print(f"{out.name}: {time.perf_counter() - t0:.0f} s")
    c = compare_runs(a, b)
    print(format_comparison(c, a, b))
    runs = {}
    for name, d in (("a", a), ("b", b)):
        s = json.loads((d / "summary.json").read_text())
        keys = (
            "mode",
            "devices",
            "steps",
            "samples_per_s",
            "steady_samples_per_s",
            "wall_seconds",
            "shifts",
            "migrations",
            "accuracy_start",
            "accuracy_end",
            "judge_agreement",
        )  # (what the README quotes)
        runs[name] = {k: s[k] for k in keys}
        print(f"{name}: {s['mode']} on {s['devices']} device(s): {s['steady_samples_per_s']:.0f} samples/s, "
              f"{s['shifts']} shifts, {s['migrations']} migrations")  # fmt: skip
    write_report(args.out, {"runs": runs, "comparison": c.to_dict(), "machine": machine(load_at_start)})


if __name__ == "__main__":
    main()
