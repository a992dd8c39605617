"""Simulator fidelity: the default CPU job run for real, then simulated with costs fitted to that run.

Cases: colocated on 1 device (in-process), and colocated, disaggregated (the
fixed --split that benchmarks/modes.py measured best) and shiftable on
--devices (Ray), as modes.py runs them. Each case runs the job for real, fits a
cost profile to the run (``pivotrl.sim.measured.fit_run``: decode line,
prefill, training, optimizer step and shifts from its events.jsonl, after the
first step, and how much shifts, backward calls and optimizer steps vary about
those costs, which the simulator draws them with), and simulates the same job with those costs and the run's
workload: the run's response lengths replayed, each sample's own (so a
group's lengths correlate as they did), prompt and judge-prompt lengths from
its tokenizers, its mean judgment length and its slice cadence.
Step time is the mean over the steps after the first (which pays first loads,
cold engines and the start-of-run evaluation), measured against predicted:
the mean of --sim-seeds simulations, each with its own seed (verdicts and
operation times are drawn; a 12-step shiftable job's step time moves by 10%
from one seed to the next), the range printed beside it.

Each case is fitted to its own run: the profile of the machine as that layout
uses it. Here a device is one CPU thread and 4 devices share 2 cores with the
Ray driver (and whatever else runs on the machine), so a decode step or a
backward costs 2-4x what it costs a device alone, and Ray's round trips add
to every slice: a profile measured in one layout is a different machine from
another's. The column ``x1 profile`` shows how far one profile carries: every
case simulated with the costs of the colocated run on 1 device.

    python benchmarks/fidelity.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import ensure_models, machine, write_report

from pivotrl.config import load_config
from pivotrl.log import setup_logging
from pivotrl.model.tokenizer import Tokenizer
from pivotrl.runtime.job import run_job
from pivotrl.sim.costs import SPREAD_KINDS
from pivotrl.sim.measured import RunFit, fit_run
from pivotrl.sim.run import run_simulation
from pivotrl.sim.workload import group_correlation

ROOT = Path(__file__).resolve().parents[1]
BEST_SPLIT = "rollout:1,judge:2,train:1"  # benchmarks/modes.py's best static split of 4 devices
PHASES = ("rollout", "judge", "train", "shift")


def cases(devices: int, split: str, modes: list[str]) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each case to run."""
    out = [("colocated x1", ["mode=colocated", "devices=1"])] if "colocated" in modes else []
    for mode in modes:
        if not (mode == "colocated" and devices == 1):
            extra = [f"split={split}"] if mode == "disaggregated" else []
            out.append((f"{mode} x{devices}", [f"mode={mode}", f"devices={devices}", *extra]))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps (metrics or samples) after the first; all of them for a one-step run."""
    return [r for r in rows if r["step"] > 1] or rows


def workload(run: Path, fit: RunFit) -> list[str]:
    """``sim.*`` overrides that make the simulated job the real one; writes the length trace into ``run``."""
    cfg = json.loads((run / "config.json").read_text())
    samples = steady(read_jsonl(run / "samples.jsonl"))
    metrics = steady(read_jsonl(run / "metrics.jsonl"))
    trace = run / "lengths.jsonl"
    trace.write_text("".join(json.dumps({"step": s["step"], "uid": s["uid"], "length": len(s["response_ids"])}) + "\n"
                             for s in read_jsonl(run / "samples.jsonl")))  # fmt: skip
    policy, judge = Tokenizer.load(cfg["policy"]["path"]), Tokenizer.load(cfg["judge"]["path"])
    references = {p["question"]: p["reference"] for p in read_jsonl(Path(cfg["task"]["train_file"]))}
    prompts = [len(policy.encode(cfg["task"]["prompt_template"].format(question=s["question"]))) for s in samples]
    prompt_len = round(sum(prompts) / len(prompts))
    template = cfg["judge"]["template"]
    extra = [  # judge prompt tokens beside the policy prompt and the response (in policy tokens, as simulated)
        len(judge.encode(template.format(question=s["question"], reference=references[s["question"]],
                                         response=s["response"]))) - prompt_len - len(s["response_ids"])
        for s in samples
    ]  # fmt: skip
    per_step = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]
    judgment = sum(m["judge_tokens"] for m in metrics) / (per_step * len(metrics))
    return [
        f"sim.lengths_file={trace}",
        "sim.lengths_replay=true",
        f"sim.prompt_len={prompt_len}",
        f"sim.judge_template_len={max(0, round(sum(extra) / len(extra)))}",
        f"sim.judge_output_len={max(1, round(judgment))}",
        f"sim.yes_probability={sum(s['reward'] for s in samples) / len(samples):.4f}",
        f"sim.slice_s={fit.slice_s:.4f}",
    ]


def length_correlation(run: Path) -> float:
    """How alike a group's response lengths were in the run (``workload.group_correlation``): replayed,
    the simulated groups are as alike; reported beside the error."""
    groups: dict[tuple[int, str], list[int]] = {}
    for s in steady(read_jsonl(run / "samples.jsonl")):
        groups.setdefault((s["step"], s["question"]), []).append(len(s["response_ids"]))
    return group_correlation(list(groups.values()))


def simulate(config: Path, job: list[str], devices: int, costs: Path, out: Path, seeds: int) -> dict[str, Any]:
    """Phases of the simulated job, the mean over ``seeds`` simulations (the job's seed and the next
    ones: each draws its own verdicts and operation times), and each one's step seconds."""
    cfg = load_config(config, [*job, f"sim.gpus={devices}", "tensor_parallel=1", f"sim.costs={costs}"], simulated=True)
    runs = []
    for k in range(seeds):
        run_simulation(replace(cfg, seed=cfg.seed + k), out / f"seed{k}", progress=False)
        runs.append(phases(read_jsonl(out / f"seed{k}" / "metrics.jsonl")))
    mean: dict[str, Any] = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
    return {**mean, "step_by_seed": [r["step"] for r in runs]}


def phases(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Steady seconds per step (mean and median) and per phase (mean)."""
    rows = steady(metrics)
    times = sorted(m["step_seconds"] for m in rows)
    out = {"step": sum(times) / len(times), "median": (times[len(times) // 2] + times[(len(times) - 1) // 2]) / 2}
    for k in PHASES[:3]:
        out[k] = sum(m["time_s"][k] for m in rows) / len(rows)
    out["shift"] = sum(m["shift_seconds"] for m in rows) / len(rows)
    return out


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured * 100


def run_case(args: argparse.Namespace, work: Path, name: str, overrides: list[str], x1: Path | None) -> dict[str, Any]:
    """The real run, its fit and its simulations (own profile; the 1-device profile when there is one)."""
    slug = name.replace(" ", "_")
    real = work / f"{slug}_real"
    job = [f"steps={args.steps}", "eval.every=0", *overrides]
    cfg = load_config(args.config, job)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    run_job(cfg, real, progress=False)
    real_s, load = time.perf_counter() - t0, [*load, os.getloadavg()[0]]
    fit = fit_run(real)
    costs = work / f"{slug}_costs.json"
    fit.costs.save(costs)
    job += workload(real, fit)
    measured = phases(read_jsonl(real / "metrics.jsonl"))
    predicted = simulate(args.config, job, cfg.devices, costs, work / f"{slug}_sim", args.sim_seeds)
    row = {"case": name, "mode": cfg.mode, "devices": cfg.devices, "split": cfg.split, "measured": measured,
           "predicted": predicted, "error_pct": error(predicted["step"], measured["step"]),
           "costs": fit.costs.to_dict(), "fit": fit.report, "job": job, "real_seconds": real_s,
           "length_group_correlation": length_correlation(real),
           "load_average_1min": load}  # fmt: skip
    if x1 is not None and x1 != costs:
        cross = simulate(args.config, job, cfg.devices, x1, work / f"{slug}_sim_x1", args.sim_seeds)
        row["x1_profile"] = {"predicted": cross, "error_pct": error(cross["step"], measured["step"])}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/default.yaml")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--split", default=BEST_SPLIT, help="disaggregated layout")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--modes", default="colocated,disaggregated,shiftable")
    p.add_argument("--sim-seeds", type=int, default=5, help="simulations per case, a seed each; predicted: their mean")
    p.add_argument("--keep", type=Path, help="keep the real and simulated run directories here")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fidelity.json")
    args = p.parse_args()
    setup_logging()
    ensure_models(args.config)
    load_at_start = list(os.getloadavg())
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        x1: Path | None = None
        for name, overrides in cases(args.devices, args.split, args.modes.split(",")):
            try:
                row = run_case(args, work, name, overrides, x1)
            except Exception as e:  # a failed case is reported and fails the benchmark; the others still run
                traceback.print_exc()
                failed.append(f"{name}: {type(e).__name__}: {e}")
                continue
            rows.append(row)
            x1 = work / "colocated_x1_costs.json" if name == "colocated x1" else x1
            m, q = row["measured"], row["predicted"]
            print(f"{name}: measured {m['step']:.2f} s/step, predicted {q['step']:.2f} ({row['error_pct']:+.1f}%)",
                  flush=True)  # fmt: skip

    print(
        f"\n{'case':<18} {'measured':>9} {'predicted':>10} {'error':>7} {'seeds':>13} {'median':>13} {'x1 profile':>11}"
        f" {'load':>9}"
    )
    for r in rows:
        m, q = r["measured"], r["predicted"]
        x1_err = f"{r['x1_profile']['error_pct']:+.0f}%" if "x1_profile" in r else "-"
        load = "-".join(f"{v:.1f}" for v in r["load_average_1min"])
        seeds = f"{min(q['step_by_seed']):.2f}-{max(q['step_by_seed']):.2f}s"
        print(f"{r['case']:<18} {m['step']:>8.2f}s {q['step']:>9.2f}s {r['error_pct']:>+6.1f}% {seeds:>13} "
              f"{m['median']:>5.2f}/{q['median']:<5.2f}s  {x1_err:>10} {load:>9}")  # fmt: skip
    print(f"\n{'phase s/step, measured/predicted':<18} " + " ".join(f"{k:>13}" for k in PHASES))
    for r in rows:
        cells = " ".join(f"{r['measured'][k]:>6.2f}/{r['predicted'][k]:<6.2f}" for k in PHASES)
        print(f"{r['case']:<18} {cells}")
    print(
        "(judge: first to last judgment of a step; simulated judgments all have the mean length, so they end together)"
    )
    print(f"\n{'fitted spread (cv)':<18} " + " ".join(f"{k:>10}" for k in SPREAD_KINDS))
    for r in rows:
        spread = r["costs"].get("spread", {})
        print(f"{r['case']:<18} " + " ".join(f"{spread.get(k, 0.0):>10.2f}" for k in SPREAD_KINDS))
    for f in failed:
        print(f"failed: {f}")
    report = {"steps": args.steps, "devices": args.devices, "split": args.split, "rows": rows, "failed": failed}
    write_report(args.out, {**report, "machine": machine(load_at_start)})
    # a case that failed has no error to take the worst of: the line says so rather than read as all of them
    unmeasured = f"; not measured: {', '.join(f.split(':')[0] for f in failed)}" if failed else ""
    if rows:
        worst = max(rows, key=lambda r: abs(r["error_pct"]))
        print(f"fidelity: worst step-time error {abs(worst['error_pct']):.1f}% ({worst['case']}){unmeasured}")
    else:
        print(f"fidelity: no case measured{unmeasured}")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
