"""Instances of several devices learn what instances of one learn: tensor_parallel=2 against 1, side by side.

Runs the default job twice with the same seed, shiftable on ``--devices`` Ray
devices with the policy and the judge on vLLM: once with instances of one device
(``tensor_parallel=1``), once with instances of ``--tp`` (each engine tensor
parallel over its instance's devices, the roles shifting whole instances). It
compares them sample by sample (``pivotrl compare``) and prints, for each, the
held-out accuracy at the start and the end, samples/s, shifts, migrations, the
migration audit, and for the instances the bytes each engine rank copied per
load against the whole version.

    python benchmarks/tensor_parallel.py               # the config's steps; long on 2 cores
    python benchmarks/tensor_parallel.py --steps 10
    python benchmarks/tensor_parallel.py --runs runs/tp1 runs/tp2
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
from pivotrl.telemetry import read_events

ROOT = Path(__file__).resolve().parents[1]
VLLM = ["mode=shiftable", "rollout.backend=vllm", "judge.backend=vllm"]
KEYS = ("tensor_parallel", "steps", "samples_per_s", "steady_samples_per_s", "wall_seconds", "shifts", "migrations",
        "accuracy_start", "accuracy_end", "accuracy_gain", "judge_agreement")  # fmt: skip


def loads(run: Path) -> dict[str, int]:
    """Bytes of the engines' loads at shifts: the whole versions, and what the busiest rank copied of them."""
    whole = ranks = 0
    for e in read_events(run):
        if e.role == "shift" and "engine_pid" in e.args:
            whole += e.args["bytes"]
            ranks += e.args.get("rank_bytes", e.args["bytes"])
    return {"bytes_loaded": whole, "largest_rank_bytes": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/default.yaml")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="devices of an instance in the second run")
    p.add_argument("--steps", type=int, default=None, help="default: the config's")
    p.add_argument("--runs", nargs=2, type=Path, metavar=("TP1", "TPN"), help="compare these run directories")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tensor_parallel.json")
    p.add_argument("overrides", nargs="*", help="key=value for both runs (policy.path=..., judge.path=...)")
    args = p.parse_args()
    setup_logging()
    load_at_start = list(os.getloadavg())
    if args.runs:
        a, b = args.runs
    else:
        base = [*VLLM, f"devices={args.devices}", *args.overrides]
        base += [] if args.steps is None else [f"steps={args.steps}"]
        ensure_models(args.config, base)
        a, b = ROOT / "runs/tensor_parallel_1", ROOT / f"runs/tensor_parallel_{args.tp}"
        for out, tp in ((a, 1), (b, args.tp)):
            t0 = time.perf_counter()
            run_job(load_config(args.config, [*base, f"tensor_parallel={tp}"]), out, progress=False)
            print(f"{out.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    c = compare_runs(a, b)
    print(format_comparison(c, a, b))
    runs = {}
    print(f"{'tp':>3} {'acc start':>9} {'acc end':>8} {'gain':>6} {'samples/s':>9} {'shifts':>6} {'migr':>5} "
          f"{'audit':>9} {'rank/whole bytes':>16}")  # fmt: skip
    for d in (a, b):
        s = json.loads((d / "summary.json").read_text())
        row = {k: s.get(k) for k in KEYS} | {"tensor_parallel": s["plan"].get("tensor_parallel", 1)}
        row |= {"migration_audit": s.get("migration_audit"), **loads(d)}
        runs[str(row["tensor_parallel"])] = row
        audit = s.get("migration_audit") or {}
        share = row["largest_rank_bytes"] / max(1, row["bytes_loaded"])
        print(f"{row['tensor_parallel']:>3} {s['accuracy_start']:>9.3f} {s['accuracy_end']:>8.3f} "
              f"{s['accuracy_gain']:>+6.3f} {s['steady_samples_per_s']:>9.1f} {s['shifts']:>6} {s['migrations']:>5} "
              f"{audit.get('identical', 0):>4}/{audit.get('checked', 0):<4} {share:>16.2f}")  # fmt: skip
    gains = [r["accuracy_gain"] for r in runs.values()]
    report = {"runs": runs, "gain_difference": round(abs(gains[0] - gains[1]), 4),
              "comparison": c.to_dict(), "machine": machine(load_at_start)}  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
