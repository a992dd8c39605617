"""Overlapping steps learn what on-policy steps learn: max_staleness 0, 1 and 2 side by side, over seeds.

Runs the default job (shiftable on its Ray devices) for each variant and seed:
``max_staleness=0`` (on-policy), 1 and 2 with ``train.correction=tis``, 1 and 2
with no correction (what the correction buys), and 2 with the masked
corrections (``mis``, ``decoupled``). Prints, per variant, the held-out
accuracy at the end (mean over seeds, and each seed's), its difference from
on-policy, samples/s, and the samples by versions behind; writes the JSON and
a PNG of the held-out curves (mean over seeds) beside it. A run whose
directory already holds a summary is read, not run again, so an interrupted
benchmark goes on where it stopped.

    python benchmarks/staleness.py                       # 7 variants x 3 seeds of the config's steps
    python benchmarks/staleness.py --steps 10 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import ensure_models, machine, write_report

from pivotrl.config import load_config
from pivotrl.log import setup_logging
from pivotrl.runtime.job import run_job

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> overrides
    "k0": ["max_staleness=0"],
    "k1-tis": ["max_staleness=1", "train.correction=tis"],
    "k2-tis": ["max_staleness=2", "train.correction=tis"],
    "k1-none": ["max_staleness=1", "train.correction=none"],
    "k2-none": ["max_staleness=2", "train.correction=none"],
    "k2-mis": ["max_staleness=2", "train.correction=mis"],
    "k2-decoupled": ["max_staleness=2", "train.correction=decoupled"],
}


def read_run(run: Path) -> dict:
    """What a finished run says: the held-out curve (step -> accuracy, step 0 the start), its rate and lags."""
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = {0: summary["accuracy_start"]} | {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r}
    lags: dict[str, int] = {}
    per_step = summary["samples"] // max(1, len(rows))
    for r in rows:  # (on-policy rows say no lag: every sample is of the version its step trains)
        for lag, n in r.get("staleness", {"0": per_step}).items():
            lags[lag] = lags.get(lag, 0) + n
    weights = [r["train_is_weight_mean"] for r in rows if "train_is_weight_mean" in r]
    capped = [r["train_is_capped_frac"] for r in rows if "train_is_capped_frac" in r]
    return {
        "curve": {str(k): v for k, v in sorted(curve.items())},
        "accuracy_end": summary["accuracy_end"],
        "samples_per_s": summary["samples_per_s"],
        "steady_samples_per_s": summary["steady_samples_per_s"],
        "wall_seconds": summary["wall_seconds"],
        "lags": dict(sorted(lags.items(), key=lambda kv: int(kv[0]))),
        "is_weight_mean": statistics.fmean(weights) if weights else None,
        "is_capped_frac": statistics.fmean(capped) if capped else None,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in report["variants"].items():
        steps = sorted(int(s) for s in v["curve_mean"])
        ax.plot(steps, [v["curve_mean"][str(s)] for s in steps], marker="o", ms=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.set_title("default job, shiftable on 4 CPU devices: max_staleness and correction")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/default.yaml")
    p.add_argument("--steps", type=int, default=None, help="default: the config's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--runs", type=Path, default=ROOT / "runs/staleness", help="where the runs are written")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/staleness.json")
    p.add_argument("overrides", nargs="*", help="key=value for every run (policy.path=..., judge.path=...)")
    args = p.parse_args()
    setup_logging()
    load_at_start = list(os.getloadavg())
    base = [*args.overrides] + ([] if args.steps is None else [f"steps={args.steps}"])
    ensure_models(args.config, base)
    runs: dict[str, dict[int, dict]] = {}
    for name in args.variants:
        for seed in args.seeds:
            out = args.runs / f"{name}-seed{seed}"
            if not (out / "summary.json").exists():
                t0 = time.perf_counter()
                run_job(load_config(args.config, [*base, *VARIANTS[name], f"seed={seed}"]), out, progress=False)
                print(f"{out.name}: {time.perf_counter() - t0:.0f} s", flush=True)
            runs.setdefault(name, {})[seed] = read_run(out)
    on_policy = runs.get("k0")
    variants = {}
    for name, by_seed in runs.items():
        seeds = list(by_seed.values())
        steps = sorted({s for r in seeds for s in r["curve"]}, key=int)
        curve = {s: statistics.fmean(r["curve"][s] for r in seeds if s in r["curve"]) for s in steps}
        end = statistics.fmean(r["accuracy_end"] for r in seeds)
        row = {
            "overrides": VARIANTS[name],
            "accuracy_end_mean": round(end, 4),
            "accuracy_end_by_seed": {str(k): r["accuracy_end"] for k, r in by_seed.items()},
            "curve_mean": {s: round(v, 4) for s, v in curve.items()},
            "samples_per_s_mean": round(statistics.fmean(r["samples_per_s"] for r in seeds), 2),
            "steady_samples_per_s_mean": round(statistics.fmean(r["steady_samples_per_s"] for r in seeds), 2),
            "lags": {
                lag: sum(r["lags"].get(lag, 0) for r in seeds)
                for lag in sorted({x for r in seeds for x in r["lags"]}, key=int)
            },  # fmt: skip
            "is_weight_mean": seeds[0]["is_weight_mean"] and statistics.fmean(r["is_weight_mean"] for r in seeds),
            "runs": {str(k): r for k, r in by_seed.items()},
        }
        if on_policy is not None:
            base_end = statistics.fmean(r["accuracy_end"] for r in on_policy.values())
            row["accuracy_end_vs_on_policy"] = round(end - base_end, 4)
        variants[name] = row
    print(f"{'variant':<9} {'acc end':>8} {'vs k0':>7} {'by seed':<22} {'samples/s':>9} {'steady':>7}  lags")
    for name, v in variants.items():
        by_seed = " ".join(f"{a:.3f}" for a in v["accuracy_end_by_seed"].values())
        print(f"{name:<9} {v['accuracy_end_mean']:>8.3f} {v.get('accuracy_end_vs_on_policy', 0.0):>+7.3f} "
              f"{by_seed:<22} {v['samples_per_s_mean']:>9.1f} {v['steady_samples_per_s_mean']:>7.1f}  "
              f"{v['lags']}")  # fmt: skip
    report = {"variants": variants, "seeds": args.seeds, "config": str(args.config.relative_to(ROOT)),
              "overrides": base, "machine": machine(load_at_start)}  # fmt: skip
    write_report(args.out, report)
    plot(report, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
