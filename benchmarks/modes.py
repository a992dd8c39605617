"""Deployment modes side by side on the same job: samples/s and ratios.

Runs the default job (or --config) in colocated mode, in disaggregated mode
with every static split of the devices (the best one is the baseline: a fair
comparison), and in shiftable mode when it is available, all with the same
seed and data, one after the other in one process. Throughput is the steady
rate (steps after the first, which pays the devices' first loads).

    python benchmarks/modes.py --devices 4 --steps 12
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path

from common import ensure_models, machine, write_report

from pivotrl.config import load_config
from pivotrl.log import setup_logging
from pivotrl.runtime.job import run_job

ROOT = Path(__file__).resolve().parents[1]


def splits(devices: int) -> list[str]:
    """Every rollout/judge/train split with at least one device per role."""
    out = []
    for r, g in itertools.product(range(1, devices), repeat=2):
        t = devices - r - g
        if t >= 1:
            out.append(f"rollout:{r},judge:{g},train:{t}")
    return out


def run(config: Path, overrides: list[str], out: Path) -> dict:
    cfg = load_config(config, overrides)
    t0 = time.perf_counter()
    summary = run_job(cfg, out, progress=False)
    summary["process_seconds"] = time.perf_counter() - t0
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/default.yaml")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--modes", default="colocated,disaggregated,shiftable")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/modes.json")
    args = p.parse_args()
    setup_logging()
    ensure_models(args.config)
    load_at_start = list(os.getloadavg())
    base = [f"devices={args.devices}", f"steps={args.steps}", "eval.every=0"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            variants = [""] if mode != "disaggregated" else splits(args.devices)
            for split in variants:
                name = f"{mode} {split}".strip()
                overrides = [*base, f"mode={mode}"] + ([f"split={split}"] if split else [])
                try:
                    s = run(args.config, overrides, Path(tmp) / name.replace(" ", "_").replace(":", ""))
                except ValueError as e:  # e.g. shiftable not available yet
                    print(f"{name}: skipped ({e})")
                    continue
                rows.append({"mode": mode, "split": split, **{k: s[k] for k in (
                    "steady_samples_per_s", "samples_per_s", "accuracy_end", "shifts", "migrations",
                    "device_idle_fraction", "role_busy_fraction", "process_seconds",
                    "driver_wait_share")}})  # fmt: skip
    best = {}
    for r in rows:
        if r["mode"] not in best or r["steady_samples_per_s"] > best[r["mode"]]["steady_samples_per_s"]:
            best[r["mode"]] = r
    print(f"\n{'mode':<14} {'split':<28} {'samples/s':>10} {'idle':>6} {'wait':>6} {'shifts':>7} {'migr':>5} "
          f"{'acc_end':>8}")  # fmt: skip
    for r in rows:
        mark = " *" if best[r["mode"]] is r and r["mode"] == "disaggregated" else ""
        print(f"{r['mode']:<14} {r['split']:<28} {r['steady_samples_per_s']:>10.1f} {r['device_idle_fraction']:>6.2f} "
              f"{r['driver_wait_share']['max']:>6.3f} {r['shifts']:>7} {r['migrations']:>5} "
              f"{r['accuracy_end']:>8.3f}{mark}")  # fmt: skip
    ratios = {}
    if "shiftable" in best:
        for other in ("colocated", "disaggregated"):
            if other in best:
                ratios[f"shiftable_vs_{other}"] = (
                    best["shiftable"]["steady_samples_per_s"] / best[other]["steady_samples_per_s"]
                )
    if "colocated" in best and "disaggregated" in best:
        ratios["disaggregated_vs_colocated"] = (
            best["disaggregated"]["steady_samples_per_s"] / best["colocated"]["steady_samples_per_s"]
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    report = {"devices": args.devices, "steps": args.steps, "rows": rows, "best": best, "ratios": ratios}
    write_report(args.out, {**report, "machine": machine(load_at_start)})


if __name__ == "__main__":
    main()
