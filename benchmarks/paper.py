"""Shiftable against its baselines on cluster-scale jobs, next to the ideal throughput.

Six model groups (policy + generative judge) on 128 simulated H100s, each run
with ``pivotrl simulate examples/sim128.yaml`` in colocated (deployed and
strong), disaggregated and shiftable mode, every run in its own process:

    dense-7b         Qwen2.5-7B policy,  Qwen2.5-7B judge      dense pair
    moe-30b          Qwen3-30B-A3B,      Qwen3-30B-A3B judge   MoE pair
    judge-32b        Qwen2.5-7B policy,  Qwen2.5-32B judge     a GenRM larger than the policy
    dense-14b        Qwen2.5-14B policy, Qwen2.5-14B judge     a larger dense pair
    reasoning-judge  Qwen2.5-7B policy,  Qwen2.5-14B judge     a judge that reasons: judgments lognormal,
                                                               median 1024, sigma 0.8, cap 8192 (assumed)
    long-rollout     Qwen2.5-7B policy,  Qwen2.5-7B judge      rollouts to 16k tokens (median 2400)

Two colocated baselines. The strong one is the best colocated schedule we can
model: phase switches of ~1 s (pivotrl's shift costs) and in-flight
rebalancing of the rollout. The deployed one is colocated as today's
frameworks (verl, NeMo-RL, slime) run it: ``sim.costs=deployed`` prices each
phase switch at its published cost (``pivotrl.sim.costs.DeployedCosts``: the
engines put to sleep and woken, the policy's weights synced into the rollout
engine each step, the trainer's state offloaded and loaded back, each number
with its public source), the colocated judge is woken once the whole rollout
has ended, and no sequence moves between engines within a step
(``rollout.rebalance=false``). Both get the instance size where they are
fastest, as every mode does.

Workload (sim128.yaml): 512 prompts x 16 responses a step, prompts of 512
tokens, lognormal response lengths (median 1200, sigma 0.9, capped at 8192),
judge prompts of prompt + response + 256 tokens, 512-token judgments, at
most 256 sequences per engine. Costs: ``RooflineCosts`` (H100 datasheet peaks
times the efficiencies documented in ``pivotrl/sim/costs.py``). Training
recomputes each layer's forward in its backward (4 forward passes a token
instead of 3): ``train.activation_checkpointing=auto`` resolves on for every
policy here, as on an 80 GB GPU the 16k-token micro batches' activations do
not fit beside the trainer unchecked.

Tensor parallelism: every instance is one engine a role, of
``sim.instance_gpus`` GPUs, policy and judge alike (``layouts.py`` measures
engines of their own size per role, and an elastic bound, beside these: they
move no mode by more than 5%). Each mode runs at the power of two from 1
to 8 where it is fastest, measured (``--tp`` forces one for all): a smaller
instance has more of them and room for larger batches per GPU, a larger one
decodes each token sooner (the weights and the KV cache read by more GPUs at
once) and pays more collectives. These steps are bound by their longest
responses more than by their work, so the fastest instance size is often
larger than the one with the highest ideal throughput. Sizes are tried from
the one with the highest floor bound (below) down; a size whose bound is no
better than the mode's best run so far is skipped, since no run there can
beat it. The disaggregated baseline's split search runs at each size tried.

Steady state: ``--steps`` steps (default 8) per run; the first is left out
(it runs on the planner's priors and pays every device's first load). A
mode's throughput is samples per step over the mean of the other steps'
times; busy fractions, shifts and shift seconds are taken over the same
window (from the end of step 1 to the end of the last step).

The disaggregated baseline gets its best static split and instance size,
searched on the steady step time of shorter runs (``--search-steps``,
default 4: 3 steady steps), then run again with ``--steps``. At each size
the search starts at the split that gives each role devices in proportion
to its ideal work, evaluates the 3x3 grid of (judge, train) device counts
around it at a spacing of D/8 devices (D instances), re-centred on the best
while it moves; then a compass search
(moving s devices from any role to any other, six neighbours) at D/16, D/32,
..., re-centred while it improves, down to one device or ``--search-levels``
halvings. A split is never run twice: 9 runs for the first grid, at most 5
more per re-centring and 6 per compass move, stopped at ``--search-budget``
(default 24 per instance size, which the 128-GPU groups reach); every run is
in the report.

Ideal throughput (``pivotrl.sim.ideal``): every piece of a step's work priced
by the same cost model at the best batch the KV memory allows (rollout and
judge prefill and decode, training forward and backward, the optimizer update
on one instance), in GPU-seconds, divided by the cluster's GPUs: no idle time,
no shifts, no weight refreshes, no gradient sync. Each mode's share of it
says how much of the cluster the mode leaves unused. Next to it, the step
floor, the longest of four: the ideal step; the spread path (the step's
longest response generated beside its even share of the others on every
instance, judged alone, its backward and the optimizer step); the group path
(a group trains once all of its responses are judged: the groups that hold
the longest responses, about a quarter of them, all train after those end
and are judged); and the joint floor, which prices the first two at once, the
groups' backward after the last token (at each decode step of the rollout's
tail, either every instance decodes small batches while the other work
waits, or few decode full ones and the tail slows: the best of these trades,
bounded from below by its Lagrangian dual). No on-policy step that does not
know the lengths in advance is shorter; the chart marks the throughput it
allows, and each group's note says the most any schedule could gain over
each baseline.
(The critical path, the same response generated at batch 1, is printed too:
a looser floor.)

Writes ``benchmarks/results/paper.{json,md,png}``: the JSON has a ``groups``
list (per group ``name``, ``ideal``, ``modes``, ``ideal_fraction`` and
``floor_fraction`` per mode (its throughput over the ideal's and over the
floor's), ``speedup_vs_deployed_colocated``, ``speedup_vs_colocated``,
``speedup_vs_disaggregated``, the search's runs),
the markdown the table with its assumptions, the PNG the bar chart.

``--sweep`` instead runs the dense-7b job across the length tail (uniform,
lognormal sigma 0.5 / 0.9 / 1.3 and a Pareto tail, all at the mean length of
sim128.yaml's), the judge size (1.5B, 14B, 32B beside the 7B policy), the
judgment length (a judge that reasons: lognormal judgments, median 512 and
1200 tokens) and the cluster size (``--sweep-gpus``, 32 to 1024; ``--axes``
picks axes), and writes
``paper_sweep.{json,md,png}`` (the JSON after every point, so a long sweep
keeps what it finished).

    .venv/bin/python benchmarks/paper.py                        # main table, ~40 min on 2 cores
    .venv/bin/python benchmarks/paper.py --quick                # smoke run: 32 GPUs, 3 steps, ~4 min
    .venv/bin/python benchmarks/paper.py --groups dense-7b --steps 6
    .venv/bin/python benchmarks/paper.py --sweep --steps 6 --search-budget 12   # sensitivity, ~35 min
    .venv/bin/python benchmarks/paper.py --update benchmarks/results/paper.json --modes shiftable  # one mode again
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import machine, write_report
from common import simulate as run_simulate

from pivotrl.config import load_config
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.ideal import INSTANCE_SIZES, IdealStep, ideal_for_job, ideals_by_size
from pivotrl.sim.models import MODELS
from pivotrl.sim.versus import LABELS, MODES, ROLES, Split, best_size, mode_overrides, search_split, split_text
from pivotrl.sim.workload import LengthDist

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/sim128.yaml"
RESULTS = ROOT / "benchmarks/results"
TPS = INSTANCE_SIZES


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    policy: str
    genrm: str
    what: str
    extra: tuple[str, ...] = ()  # further overrides (a sweep point's lengths, say)


GROUPS = {
    g.name: g
    for g in (
        Group("dense-7b", "Qwen2.5-7B", "Qwen2.5-7B", "dense pair"),
        Group("moe-30b", "Qwen3-30B-A3B", "Qwen3-30B-A3B", "MoE pair"),
        Group("judge-32b", "Qwen2.5-7B", "Qwen2.5-32B", "judge larger than the policy"),
        Group("dense-14b", "Qwen2.5-14B", "Qwen2.5-14B", "larger dense pair"),
        # a judge that thinks before its verdict: judgments of varying length with a long tail. Public GenRM
        # recipes cap them at 4k-16k tokens (DeployedCosts' sources); no length distribution is published, so
        # this is an assumption: lognormal, median 1024, sigma 0.8 (about 0.5% reach the 8192 cap)
        Group(
            "reasoning-judge",
            "Qwen2.5-7B",
            "Qwen2.5-14B",
            "a larger judge that reasons",
            ("sim.judge_output_len=1024", "sim.judge_output_sigma=0.8", "judge.max_new_tokens=8192"),
        ),
        # reasoning RL: rollouts capped at 16k tokens (Skywork-OR1, DeepScaleR's second stage; DAPO 20k),
        # sim128.yaml's length shape at twice its median (about 2% reach the cap)
        Group(
            "long-rollout",
            "Qwen2.5-7B",
            "Qwen2.5-7B",
            "rollouts to 16k tokens",
            ("sim.lengths.median=2400", "rollout.max_new_tokens=16384", "eval.max_new_tokens=16384"),
        ),
    )
}


# -- the job and its ideal ------------------------------------------------------------------


def job_overrides(group: Group, gpus: int, tp: int) -> list[str]:
    # eval.size: the held-out evaluations run at the start and after the last step, outside the window measured
    return [f"sim.policy_model={group.policy}", f"sim.genrm_model={group.genrm}", f"sim.gpus={gpus}",
            f"sim.instance_gpus={tp}", f"train.backend={trainer(group.policy, gpus)}", "eval.size=16",
            *group.extra]  # fmt: skip


@functools.cache
def trainer(policy: str, gpus: int) -> str:
    """Every mode's trainer for ``policy``: ZeRO-1 where its state fits on the modeled GPUs (6 bytes a parameter
    whole on each; it backpropagates each group as soon as it is judged), else FSDP2 (a 14B policy or larger on
    80 GB GPUs). The strongest that fits, for the baselines as for shiftable; ``train.backend=auto`` would give
    the static modes FSDP2."""
    cfg = load_config(EXAMPLE, [f"sim.policy_model={policy}", f"sim.gpus={gpus}"])
    shape = MODELS[policy].train_config()
    fits = shape is not None and cfg.train.fewest_devices(shape, "zero", gpus, GPUS[cfg.sim.gpu].hbm_bytes, "cuda")
    return "zero" if fits else "fsdp"


def ideal(overrides: list[str]) -> IdealStep:
    return ideal_for_job(load_config(EXAMPLE, [*overrides, "mode=colocated"]))


def instance_sizes(group: Group, gpus: int, tps: tuple[int, ...] = TPS) -> dict[int, IdealStep]:
    """The ideal of each instance size of ``tps`` both models fit on, with an instance for each role."""
    found = ideals_by_size(load_config(EXAMPLE, job_overrides(group, gpus, 1)), tps)
    out = {tp: step for tp, step in found.items() if gpus // tp >= 3}
    if not out:
        raise SystemExit(f"{group.name}: no instance size in {tps} fits both models on {gpus} GPUs")
    return out


def with_tp(overrides: list[str], tp: int) -> list[str]:
    """``overrides`` with instances of ``tp`` GPUs."""
    return [x for x in overrides if not x.startswith("sim.instance_gpus=")] + [f"sim.instance_gpus={tp}"]


def floor_rate(i: dict[str, Any]) -> float:
    """``IdealStep.floor_samples_per_s`` of a report's ideal (older reports do not have it)."""
    return i["samples_per_s"] * i["step_seconds"] / i["floor_seconds"]


# -- one run --------------------------------------------------------------------------------


def steady(run_dir: Path) -> dict[str, Any]:
    """Throughput, step time, busy fractions and shifts over the steps after the first."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics  # the window of summary.json's steady_samples_per_s
    step_s = sum(m["step_seconds"] for m in later) / len(later)
    rollout_s = sum(m["time_s"]["rollout"] for m in later) / len(later)  # from a step's start to its last response
    spans = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    ends: dict[int, float] = {}  # step -> end of its optimizer step
    for s in spans:
        if s["role"] == "train" and s["name"].startswith("step v"):
            v = int(s["name"].rsplit("v", 1)[1])
            ends[v] = max(ends.get(v, 0.0), s["end"])
    w0, w1 = (ends[1], ends[len(metrics)]) if len(metrics) > 1 else (0.0, ends[len(metrics)])
    busy = dict.fromkeys((*ROLES, "shift"), 0.0)
    moves = 0
    for s in spans:
        seconds = min(s["end"], w1) - max(s["start"], w0)
        if s["role"] in busy and seconds > 0:
            busy[s["role"]] += seconds
        src, _, dst = s["name"].partition("->")
        if s["role"] == "shift" and w0 <= s["start"] < w1 and src not in (dst, "none"):
            moves += 1
    capacity = summary["devices"] * (w1 - w0)
    fractions = {r: b / capacity for r, b in busy.items()} if capacity > 0 else busy
    # from a group's last response to its last judgment: how long its backward waits on the judge
    waits = [m["group_wait_s"] for m in later if m.get("group_wait_s")]
    wait = {k: sum(x[k] for x in waits) / len(waits) for k in ("median", "p90", "max")} if waits else None
    return {
        "samples_per_s": summary["steady_samples_per_s"],
        "train_backend": summary.get("train_backend"),  # (the trainer the run priced)
        "step_seconds": step_s,
        "step_seconds_each": [m["step_seconds"] for m in metrics],
        "rollout_seconds": rollout_s,
        "busy_fraction": fractions,
        "idle_fraction": max(0.0, 1 - sum(fractions.values())),
        "shifts_per_step": sum(m["shifts"] for m in later) / len(later),  # role moves and weight reloads
        "moves_per_step": moves / max(len(later), 1),  # devices changing role
        "shift_seconds_per_step": sum(m["shift_seconds"] for m in later) / len(later),  # device-seconds
        "migrations_per_step": sum(m["migrations"] for m in later) / len(later),
        "group_wait_s": wait,  # (the steps' median, 90th percentile and longest, averaged over the steps)
    }


def simulate(overrides: list[str], timeout: float, keep: Path | None = None) -> dict[str, Any]:
    """One ``pivotrl simulate`` in its own process; its steady numbers, or the error that stopped it."""
    out = Path(tempfile.mkdtemp(prefix="pivotrl-paper-"))
    wall, error = run_simulate(EXAMPLE, overrides, out, timeout)
    row: dict[str, Any] = {"wall_s": wall}
    if error:
        row["error"] = error
    else:
        row.update(steady(out))
    if keep is not None and not error:
        shutil.rmtree(keep, ignore_errors=True)
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(out), keep)
    shutil.rmtree(out, ignore_errors=True)
    return row


# -- a group in every mode ------------------------------------------------------------------


def bench(group: Group, gpus: int, args: argparse.Namespace, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """The group in every mode, each at its best instance size (``--tp``: that one for all); with ``kept``
    (the group from an earlier report, ``--update``) only the modes of ``args.modes``, the others kept."""
    t0 = time.perf_counter()
    wanted = set(args.modes) if kept is not None else set(MODES)
    sizes = instance_sizes(group, gpus, (args.tp,) if args.tp else TPS)
    tp0 = max(sizes, key=lambda tp: sizes[tp].samples_per_s)  # the highest ideal: the table's ideal row
    caps = {tp: i.floor_samples_per_s for tp, i in sizes.items()}
    keep = (lambda mode: args.runs / group.name / mode) if args.runs else (lambda mode: None)
    print(f"{group.name}: {group.policy} + {group.genrm} judge, {gpus} GPUs in instances of "
          f"{'/'.join(map(str, sizes))}; ideal {sizes[tp0].samples_per_s:.1f} samples/s (TP{tp0}), floor bound "
          + ", ".join(f"TP{tp} {cap:.1f}" for tp, cap in caps.items()), flush=True)  # fmt: skip
    modes: dict[str, dict[str, Any]] = {m: r for m, r in (kept or {}).get("modes", {}).items() if m not in wanted}
    for mode in ("deployed", "colocated", "shiftable"):
        if mode not in wanted:
            continue
        runs: dict[int, dict[str, Any]] = {}

        def run(tp: int, mode: str = mode, runs: dict[int, dict[str, Any]] = runs) -> float:
            kept = keep(f"{mode}-tp{tp}")  # (each size's run kept apart; the chosen one is renamed below)
            how = mode_overrides(mode)
            r = runs[tp] = simulate([*job_overrides(group, gpus, tp), *how, f"steps={args.steps}"], args.timeout,
                                    kept)  # fmt: skip
            print(f"  {mode} TP{tp}: {_rate(r)} ({r['wall_s']:.0f} s)", flush=True)
            return r.get("samples_per_s", 0.0)

        tp, tried = best_size(caps, run)
        chosen = tp if tp is not None else next(iter(runs))  # (every run failed: the first one's error)
        if args.runs:  # the chosen size's run is the mode's; the others go
            for size in runs:
                src = keep(f"{mode}-tp{size}")
                if size == tp:
                    shutil.rmtree(keep(mode), ignore_errors=True)
                    src.rename(keep(mode))
                else:
                    shutil.rmtree(src, ignore_errors=True)
        modes[mode] = {**runs[chosen], "instance_gpus": chosen, "sizes": tried}

    if "disaggregated" in wanted:
        disaggregated(group, gpus, args, sizes, caps, keep, modes)
    g = {
        "name": group.name,
        "what": group.what,
        "policy": group.policy,
        "genrm": group.genrm,
        "gpus": gpus,
        "instance_gpus": tp0,
        "devices": gpus // tp0,
        "overrides": job_overrides(group, gpus, tp0),
        "ideal": sizes[tp0].to_dict(),
        "ideals": {str(tp): i.to_dict() for tp, i in sizes.items()},
        "modes": {m: modes[m] for m in MODES if m in modes},
    }
    return {**derive(g), "wall_s": time.perf_counter() - t0}


def disaggregated(
    group: Group,
    gpus: int,
    args: argparse.Namespace,
    sizes: dict[int, IdealStep],
    caps: dict[int, float],
    keep: Callable[[str], Path | None],
    modes: dict[str, Any],
) -> None:
    """The best static split: searched at each instance size worth trying, then run at the best one."""
    searched: dict[int, tuple[Split, list[tuple[Split, float]]]] = {}

    def search_at(tp: int) -> float:
        devices = gpus // tp

        def evaluate(split: Split) -> float:
            r = simulate([*job_overrides(group, gpus, tp), "mode=disaggregated", f"split={split_text(split)}",
                          f"steps={args.search_steps}"], args.timeout)  # fmt: skip
            print(f"  search TP{tp} {split_text(split)}: {_rate(r)} ({r['wall_s']:.0f} s)", flush=True)
            return r.get("step_seconds", math.inf)

        seed = sizes[tp].split(devices)
        searched[tp] = search_split(evaluate, devices, (seed["rollout"], seed["genrm"], seed["train"]),
                                    args.search_levels, args.search_budget)  # fmt: skip
        step_s = min(v for _, v in searched[tp][1])
        return sizes[tp].samples / step_s if step_s < math.inf else 0.0

    tp, tried = best_size(caps, search_at)
    tp = tp if tp is not None else next(iter(searched))
    split = searched[tp][0]
    dis = simulate([*job_overrides(group, gpus, tp), "mode=disaggregated", f"split={split_text(split)}",
                    f"steps={args.steps}"], args.timeout, keep("disaggregated"))  # fmt: skip
    dis.update(split=split_text(split), instance_gpus=tp, sizes=tried)
    dis["search"] = [{"tp": t, "split": split_text(s), "step_seconds": v} for t in searched for s, v in searched[t][1]]
    modes["disaggregated"] = dis
    print(f"  disaggregated TP{tp} {dis['split']}: {_rate(dis)} after {len(dis['search'])} search runs", flush=True)


def derive(g: dict[str, Any]) -> dict[str, Any]:
    """``g`` with what follows from its runs and its ideal: each mode's share of the ideal, shiftable's
    speedups, and the most any on-policy schedule could gain over each baseline (``bound``)."""
    rate = {m: r.get("samples_per_s", 0.0) for m, r in g["modes"].items()}
    ceiling = bound(g)

    def speedup(baseline: str) -> float | None:
        return rate["shiftable"] / rate[baseline] if rate.get(baseline) and rate["shiftable"] > 0 else None

    def over(baseline: str) -> float | None:
        return ceiling / rate[baseline] if rate.get(baseline) else None

    held = lockstep_bound(g)
    lockstep = {}
    if held:  # a trainer that backpropagates at the step (FSDP2): the most any schedule of it reaches
        lockstep = {"lockstep_bound": held, "lockstep_of_floor": held / ceiling,
                    "lockstep_floor_fraction": {m: rate[m] / held for m in rate}}  # fmt: skip
    return {
        **g,
        **lockstep,
        "ideal_fraction": {m: rate[m] / g["ideal"]["samples_per_s"] for m in rate},
        # each mode's throughput as a share of the floor's (the step floor at its best instance size)
        "floor_fraction": {m: rate[m] / ceiling for m in rate},
        "speedup_vs_deployed_colocated": speedup("deployed"),
        "speedup_vs_colocated": speedup("colocated"),
        "speedup_vs_disaggregated": speedup("disaggregated"),
        "bound_vs_deployed_colocated": over("deployed"),
        "bound_vs_colocated": over("colocated"),
        "bound_vs_disaggregated": over("disaggregated"),
    }


def _rate(r: dict[str, Any]) -> str:
    return f"{r['samples_per_s']:.1f} samples/s, {r['step_seconds']:.1f} s/step" if "samples_per_s" in r else r["error"]


# -- reports --------------------------------------------------------------------------------

HEAD = ("group", "mode", "layout", "samples/s", "step s", "rollout s", "of ideal", "of floor", "rollout", "genrm",
        "train", "shift", "idle", "shifts/step", "moves/step", "shift s/step")  # fmt: skip


def modes_of(g: dict[str, Any]) -> list[str]:
    """The modes a group was run in, in table order (older reports have no deployed baseline)."""
    return [m for m in MODES if m in g["modes"]]


def rows(g: dict[str, Any], label: str | None = None) -> list[list[str]]:
    """The table rows of one group: a row per mode, then the ideal."""
    out = []
    for mode in modes_of(g):
        r = g["modes"][mode]
        layout = r.get("split", "planner" if mode == "shiftable" else "all roles") + f", TP{mode_tp(g, mode)}"
        if "samples_per_s" not in r:
            out.append([label or g["name"], LABELS[mode], layout, "failed: " + r.get("error", "?")]
                       + [""] * (len(HEAD) - 4))  # fmt: skip
            continue
        b = r["busy_fraction"]
        rollout = f"{r['rollout_seconds']:.1f}" if "rollout_seconds" in r else ""  # (older reports: not kept)
        out.append([label or g["name"], LABELS[mode], layout, f"{r['samples_per_s']:.1f}", f"{r['step_seconds']:.1f}",
                    rollout, f"{g['ideal_fraction'][mode]:.0%}", f"{g['floor_fraction'][mode]:.0%}",
                    *(f"{b[k]:.0%}" for k in (*ROLES, "shift")),
                    f"{r['idle_fraction']:.0%}", f"{r['shifts_per_step']:.0f}", f"{r['moves_per_step']:.0f}",
                    f"{r['shift_seconds_per_step']:.0f}"])  # fmt: skip
    i = g["ideal"]
    shares = {k: v / sum(i["gpu_seconds_by_role"].values()) for k, v in i["gpu_seconds_by_role"].items()}
    floor = f"{i['spread_rollout_s']:.1f}" if "spread_rollout_s" in i else ""  # the spread path's generation
    out.append([label or g["name"], "ideal", f"TP{g['instance_gpus']}, batch {i['rollout_batch']}/{i['genrm_batch']}",
                f"{i['samples_per_s']:.1f}", f"{i['step_seconds']:.1f}", floor, "100%", "",
                *(f"{shares[k]:.0%}" for k in ROLES), "0%", "0%", "", "", ""])  # fmt: skip
    return out


SPENT_HEAD = ("group", "mode", "the step's work", "rollout beyond", "judge beyond", "train beyond", "shift", "idle")


def spent(g: dict[str, Any], mode: str) -> dict[str, float] | None:
    """Where a mode's GPU-time goes, as shares of it (None for a failed run): the step's work as the ideal
    prices it (the mode's share of the ideal), each role's busy time beyond its part of that work (decoding
    in smaller batches than the ideal's, re-prefilling migrated sequences, gradient sync), shifts, idle."""
    r = g["modes"][mode]
    if "busy_fraction" not in r:
        return None
    i = g.get("ideals", {}).get(str(r.get("instance_gpus")))  # the ideal at the mode's own instance size
    work = (i or g["ideal"])["gpu_seconds_by_role"]
    useful = r["samples_per_s"] / i["samples_per_s"] if i else g["ideal_fraction"][mode]
    out = {"work": useful}
    for role in ROLES:
        out[role] = r["busy_fraction"][role] - useful * work[role] / sum(work.values())
    out["shift"], out["idle"] = r["busy_fraction"]["shift"], r["idle_fraction"]
    return out


def spent_rows(items: list[dict[str, Any]], label: str) -> list[list[str]]:
    out = []
    for g in items:
        for mode in modes_of(g):
            x = spent(g, mode)
            name = g["name"] if label == "name" else f"{g['sweep']}: {g['point']}"
            cells = [f"{v:.0%}" for v in x.values()] if x else [""] * 6
            out.append([name, LABELS[mode], *cells])
    return out


def _times(x: float | None) -> str:
    return f"{x:.2f}x" if x else "n/a"


def speedups(g: dict[str, Any]) -> str:
    tp = bound_tp(g)
    i = ideals(g)[tp]
    deployed = ""
    if "deployed" in g["modes"]:
        deployed = f"vs deployed colocated {_times(g.get('speedup_vs_deployed_colocated'))}, "
    floor = g.get("floor_fraction", {}).get("shiftable")
    return (
        f"shiftable {deployed}vs colocated {_times(g['speedup_vs_colocated'])}, "
        f"vs disaggregated {_times(g['speedup_vs_disaggregated'])}"
        + (f", at {floor:.0%} of the floor" if floor else "")
        + "; "
        f"at TP{tp} ideal step {i['step_seconds']:.0f} s, spread path {i['spread_path_s']:.0f} s (alone "
        f"{i['critical_path_s']:.0f} s), group path {i.get('group_path_s', 0):.0f} s, joint floor "
        f"{i.get('joint_floor_s', 0):.0f} s: no schedule gains more "
        f"than {_times(g.get('bound_vs_colocated'))} / {_times(g.get('bound_vs_disaggregated'))}"
        + (f" ({_times(g.get('bound_vs_deployed_colocated'))} over the deployed colocated)" if deployed else "")
        + lockstep_text(g)
    )


def lockstep_text(g: dict[str, Any]) -> str:
    """For a trainer that backpropagates at the step: the most of the floor any schedule of it reaches."""
    held = g.get("lockstep_bound")
    if not held:
        return ""
    found = {tp: i for tp, i in ideals(g).items() if i.get("lockstep_floor_s")}
    tp = min(found, key=lambda tp: found[tp]["lockstep_floor_s"])
    share = g.get("lockstep_floor_fraction", {}).get("shiftable")
    return (
        f"; its trainer backpropagates at the step (FSDP2): no schedule of it is shorter than "
        f"{found[tp]['lockstep_floor_s']:.0f} s (TP{tp}), {g['lockstep_of_floor']:.0%} of the floor's throughput"
        + (f", shiftable at {share:.0%} of that" if share else "")
    )


def gap(g: dict[str, Any]) -> str | None:
    """Where shiftable's step goes against the floor at its own instance size: when its rollout ends (the
    spread path's generation is the floor's) and how long after that the update comes (the joint floor's
    after), its shift device-seconds a device. None where a number is missing (older reports)."""
    r = g["modes"].get("shiftable", {})
    i = ideals(g).get(str(r.get("instance_gpus")))
    if not i or "after_s" not in i or "rollout_seconds" not in r:
        return None
    devices = g["gpus"] // r["instance_gpus"]
    trade = ""
    if i.get("joint_rollout_s"):  # the rollout the joint floor prices: when it ends, what its decode costs
        busy = r["busy_fraction"]["rollout"] * r["step_seconds"]  # seconds of the whole cluster
        floor = (i["joint_rollout_gpu_s"] + i["gpu_seconds"]["rollout_prefill"]) / g["gpus"]
        trade = (f", the joint floor's {i['joint_rollout_s']:.1f} s; it keeps the whole cluster {busy:.1f} s a step "
                 f"against the floor's {floor:.1f} s")  # fmt: skip
    judge = ""
    if "busy_fraction" in r and "gpu_seconds" in i:  # the judge's busy time against the floor's price of its work
        busy = r["busy_fraction"]["genrm"] * r["step_seconds"]
        work = (i["gpu_seconds"]["genrm_prefill"] + i["gpu_seconds"]["genrm_decode"]) / g["gpus"]
        judge = (f"; the judge keeps it {busy:.1f} s against the floor's {work:.1f} s, and it idles "
                 f"{r['idle_fraction'] * r['step_seconds']:.1f} s")  # fmt: skip
    if r.get("group_wait_s"):
        judge += f"; a group waits {r['group_wait_s']['median']:.1f} s for its judgments (median)"
    return (
        f"shiftable TP{r['instance_gpus']}: step {r['step_seconds']:.1f} s against a floor of "
        f"{i['floor_seconds']:.1f} s; its rollout ends at {r['rollout_seconds']:.1f} s (spread path "
        f"{i['spread_rollout_s']:.1f} s{trade}), the update {r['step_seconds'] - r['rollout_seconds']:.1f} s later "
        f"(the joint floor's {i['after_s']:.1f} s){judge}; shifts {r['shift_seconds_per_step'] / devices:.1f} s "
        "a device"
    )


def bound(g: dict[str, Any]) -> float:
    """Samples/s if a step took its floor (the longest of the ideal step and the spread, group and joint paths)
    at the instance size whose floor is lowest."""
    return max(floor_rate(i) for i in ideals(g).values())


def lockstep_bound(g: dict[str, Any]) -> float | None:
    """Samples/s if a step took the floor of its trainer where that trainer backpropagates at the step (FSDP2:
    ``IdealStep.lockstep_floor_s``), at the instance size where it is lowest; None for any other trainer."""
    rates = [i["samples_per_s"] * i["step_seconds"] / i["lockstep_floor_s"]
             for i in ideals(g).values() if i.get("lockstep_floor_s")]  # fmt: skip
    return max(rates) if rates else None


def ideals(g: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The group's ideal at each instance size it was run at (older reports: the one ideal they have)."""
    return g.get("ideals") or {str(g["instance_gpus"]): g["ideal"]}


def bound_tp(g: dict[str, Any]) -> str:
    """The instance size of ``bound``."""
    found = ideals(g)
    return max(found, key=lambda tp: floor_rate(found[tp]))


def mode_tp(g: dict[str, Any], mode: str) -> int:
    return g["modes"][mode].get("instance_gpus", g["instance_gpus"])


def text_table(table: list[list[str]], head: tuple[str, ...] = HEAD) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]

    def line(r: list[str] | tuple[str, ...]) -> str:
        return "  ".join(x.rjust(w) if i > 2 else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([line(head), *(line(r) for r in table)])


def md_table(table: list[list[str]], head: tuple[str, ...] = HEAD) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in table])


ASSUMPTIONS = """\
- Simulated with `pivotrl simulate` (the real controller, scheduler and planner on a virtual clock) on H100 SXM
  (989 TFLOP/s bf16 dense, 3.35 TB/s HBM, 80 GB, PCIe Gen5 to the host, NVLink in 8-GPU nodes, 50 GB/s per GPU
  between nodes); costs from `RooflineCosts` (datasheet peaks times the efficiencies in `pivotrl/sim/costs.py`).
- Workload `examples/sim128.yaml`: 512 prompts x 16 responses a step, 512-token prompts, lognormal response lengths
  (median 1200, sigma 0.9, cap 8192), judge prompt = prompt + response + 256 tokens, 512-token judgments,
  at most 256 sequences per engine.
- One tensor-parallel size for every instance of a run (the simulator's `sim.instance_gpus`), chosen per mode as
  the one where the mode is fastest (measured at 1, 2, 4 and 8 GPUs where the models fit, a size skipped when its
  floor bound cannot beat the best run so far; the disaggregated split searched at each size). The ideal row is
  at the size with the highest ideal throughput; the bound at the size with the lowest floor.
- Throughput over steps 2..N (step 1 runs on priors and pays the first loads); busy, shifts and shift seconds over
  the same window. Rollout s: from a step's start to its last response generated, the mean over the same steps;
  in the ideal row, the spread path's generation (a floor). Shifts count role moves and per-step weight
  reloads; moves count devices changing role; shift s is device-seconds spent shifting.
- Colocated, deployed: colocated as today's frameworks run it (`sim.costs=deployed`, `DeployedCosts` in
  `pivotrl/sim/costs.py`, each number with its public source): every step the rollout engine is woken (vLLM
  sleep mode, ~10 GB/s a GPU) and the policy's weights synced into it (dense: 4.5 s at 8B, +0.08 s a GB, from
  NeMo-RL's published refit times; MoE: 37 s, verl's Qwen3-MoE sync), the judge engine woken once the whole
  rollout has ended, each put back to sleep after, the trainer's state offloaded and loaded back
  (torch_memory_saver's 2.4 / 5.3 GiB/s); no sequence moves between engines within a step. Colocated,
  strong: pivotrl's ~1-2 s shifts and in-flight rebalancing of the rollout.
- Disaggregated: the best static split found by a grid-then-compass search on the steady step time.
- Groups reasoning-judge and long-rollout: the judgments of a judge that reasons are assumed lognormal (median
  1024 tokens, sigma 0.8, cap 8192; public GenRM recipes cap them at 4k-16k, and no distribution is published);
  long rollouts have sim128.yaml's shape at twice its median, capped at 16384 tokens. Of floor: the mode's
  throughput over the floor's (the step floor at the instance size where it is lowest).
- Ideal: all the work of a step (prefill and decode of rollout and judge at the largest batch the KV cache
  allows, training forward and backward, the optimizer update) in GPU-seconds over all GPUs; no idle time,
  no shifts, no weight refreshes, no gradient sync (`pivotrl/sim/ideal.py`). Its role columns are the
  shares of that work. The spread path is the longest response of a step generated beside its even share of
  the others on every instance (all start together; those still running at each decode step spread over
  every instance), judged alone, its backward and the optimizer step. The group path: a group trains once
  all of its responses are judged, so for every length the groups holding a response at least that long
  train, on every GPU, after it ends on the spread path and is judged. The joint floor prices the two
  together, the last groups' backward after the last token: at each decode step of the tail, the instances
  that decode the responses still running are either many (small batches, the other work waits) or few
  (full batches, the tail slows); the best trade over the whole rollout, bounded from below by its Lagrangian
  dual. No on-policy step that cannot tell the longest response in advance is shorter than the longest of
  the four (the black mark on the chart; `pivotrl/sim/ideal.py`). The critical path is the same response
  generated at batch 1, a looser floor. Where the trainer backpropagates every group at the step (FSDP2:
  the groups whose ZeRO-1 state fits no GPU), its own floor is the joint floor with every group's backward
  after the last judgment, on every GPU: no schedule of that trainer beats it."""


SPENT_NOTE = """\
The step's work is the GPU-time the ideal prices the step at (the mode's share of the ideal); a role's
"beyond" is its busy time past its part of that work: decoding in smaller batches than the ideal's (the
rollout's tail, a judge fed one response at a time), prefills of migrated sequences, the gradient sync; shift
and idle as in the table above. The columns add up to 100% (rounding aside)."""


def _short(model: str) -> str:
    return model.removeprefix("Qwen2.5-").removeprefix("Qwen3-")


def _bars(
    ax: Any, items: list[dict[str, Any]], value: Callable[[dict[str, Any], str], float], ticks: list[str]
) -> None:
    """Per item a bar for each mode and the ideal (labelled with the mode's share of the ideal), and the
    step-floor bound as a black mark over the ideal's bar."""
    colors = {"deployed": "#c8c8c8", "colocated": "#8c8c8c", "disaggregated": "#4c72b0", "shiftable": "#dd8452",
              "ideal": "#55a868"}  # fmt: skip
    shown = [m for m in MODES if all(m in g["modes"] for g in items)]
    width = 0.8 / (len(shown) + 1)
    for k, mode in enumerate((*shown, "ideal")):
        xs = [i + (k - len(shown) / 2) * width for i in range(len(items))]
        ys = [value(g, mode) for g in items]
        ideal = mode == "ideal"
        ax.bar(xs, ys, width, label=LABELS.get(mode, mode), color=colors[mode],
               edgecolor="#2d6a3e" if ideal else "white", hatch="//" if ideal else None)  # fmt: skip
        for x, y, g in zip(xs, ys, items, strict=True):
            if not ideal and y > 0:
                ax.text(x, y, f"{g['ideal_fraction'][mode]:.0%}", ha="center", va="bottom", fontsize=6)
    xs = [i + len(shown) / 2 * width for i in range(len(items))]
    ax.hlines([value(g, "bound") for g in items], [x - width / 2 for x in xs], [x + width / 2 for x in xs],
              colors="black", linewidths=1.5, label="step-floor bound")  # fmt: skip
    ax.set_xticks(range(len(items)), ticks, fontsize=7)
    ax.margins(y=0.15)


def _tick(g: dict[str, Any], label: str) -> str:
    sizes = "/".join(str(mode_tp(g, m)) for m in modes_of(g))
    return f"{g[label]}\n{_short(g['policy'])} + {_short(g['genrm'])} judge, TP {sizes}"


def plot(items: list[dict[str, Any]], path: Path, title: str, label: str) -> None:
    """Groups: samples/s side by side. Sweep points (``label`` "point"): one panel per swept axis, each mode
    as a share of its point's ideal, since throughputs of different clusters do not compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rate(g: dict[str, Any], mode: str) -> float:
        if mode == "bound":
            return bound(g)
        return g["ideal"]["samples_per_s"] if mode == "ideal" else g["modes"][mode].get("samples_per_s", 0.0)

    if label != "point":
        fig, ax = plt.subplots(figsize=(max(6, 1.9 * len(items)), 4.2))
        _bars(ax, items, rate, [_tick(g, label) for g in items])
        ax.set_ylabel("samples/s (steady)")
        ax.legend(fontsize=7, ncols=5, loc="upper right")
        ax.set_title(title, fontsize=10)
    else:
        axes = list(dict.fromkeys(g["sweep"] for g in items))
        sizes = [sum(g["sweep"] == a for g in items) for a in axes]
        fig, panels = plt.subplots(1, len(axes), figsize=(1.9 * len(items) + 1, 4.4), sharey=True, squeeze=False,
                                   gridspec_kw={"width_ratios": sizes})  # fmt: skip
        for ax, axis in zip(panels[0], axes, strict=True):
            mine = [g for g in items if g["sweep"] == axis]
            _bars(ax, mine, lambda g, m: rate(g, m) / g["ideal"]["samples_per_s"], [_tick(g, label) for g in mine])
            ax.set_title(axis, fontsize=9)
        panels[0][0].set_ylabel("share of the ideal throughput")
        panels[0][0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        fig.legend(*panels[0][0].get_legend_handles_labels(), fontsize=7, ncols=5, loc="upper right")
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


SPENT_TITLE = "Where each mode's GPU-time goes (shares of the cluster's time over the measured steps)"


def write_all(prefix: Path, report: dict[str, Any], table: list[list[str]], notes: list[str], title: str,
              label: str) -> None:  # fmt: skip
    write_report(prefix.with_suffix(".json"), report)
    items = report.get("groups") or report["points"]
    md = (f"### {title}\n\n{md_table(table)}\n\n" + "".join(f"- {n}\n" for n in notes)
          + f"\n#### {SPENT_TITLE}\n\n{md_table(spent_rows(items, label), SPENT_HEAD)}\n\n{SPENT_NOTE}\n"
          + f"\n{ASSUMPTIONS}\n")  # fmt: skip
    prefix.with_suffix(".md").write_text(md)
    plot(report.get("groups") or report["points"], prefix.with_suffix(".png"), title, label)
    print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.png')}")


# -- the sensitivity sweep ------------------------------------------------------------------


def _fit(make: Callable[[float], LengthDist], mean: float, lo: float, hi: float) -> float:
    """The parameter in [lo, hi] at which ``make(x).mean()`` (increasing in x) equals ``mean``."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if make(mid).mean() < mean else (lo, mid)
    return (lo + hi) / 2


def tail_points(cap: int = 8192) -> list[tuple[str, list[str]]]:
    """Length distributions from uniform to a heavy tail, all at the mean length of sim128.yaml's lognormal."""
    mean = LengthDist.lognormal(1200, 0.9, cap).mean()
    out = [("uniform", ["sim.lengths.kind=uniform", "sim.lengths.lo=1", f"sim.lengths.hi={round(2 * mean - 1)}"])]
    for sigma in (0.5, 0.9, 1.3):
        median = 1200 if sigma == 0.9 else _fit(lambda m, s=sigma: LengthDist.lognormal(m, s, cap), mean, 1, cap)
        out.append((f"lognormal s={sigma}", [f"sim.lengths.median={median:.1f}", f"sim.lengths.sigma={sigma}"]))
    minimum = _fit(lambda m: LengthDist.pareto(m, 1.3, cap), mean, 1, cap)
    pareto = ["sim.lengths.kind=pareto", f"sim.lengths.minimum={minimum:.1f}", "sim.lengths.alpha=1.3"]
    out.append(("pareto a=1.3", pareto))
    return out


def reasoning_points() -> list[tuple[str, list[str]]]:
    """Judges that reason before their verdict: judgments lognormal about sim128.yaml's 512 tokens, and
    about as long as the responses, each cap raised so that about 1% run into it."""
    return [
        ("median 512 s=0.9", ["sim.judge_output_sigma=0.9", "judge.max_new_tokens=4096"]),
        ("median 1200 s=0.9", ["sim.judge_output_len=1200", "sim.judge_output_sigma=0.9", "judge.max_new_tokens=8192"]),
    ]


AXES = {"length tail": "tail", "judge size": "judge", "judgment length": "reasoning", "cluster": "cluster"}


def sweep(args: argparse.Namespace, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every sweep point benched like a group; ``save`` gets the points so far after each one."""
    base = GROUPS["dense-7b"]
    points: list[tuple[str, str, Group, int]] = []
    for label, extra in tail_points():
        slug = "tail-" + label.replace(" ", "-").replace("=", "")
        points.append(("length tail", label, Group(slug, base.policy, base.genrm, base.what, tuple(extra)), args.gpus))
    for judge in ("Qwen2.5-1.5B", "Qwen2.5-14B", "Qwen2.5-32B"):
        group = Group(f"judge-{_short(judge)}", base.policy, judge, "judge size")
        points.append(("judge size", _short(judge), group, args.gpus))
    for label, extra in reasoning_points():
        slug = "reasoning-" + label.split(" ")[0]
        points.append(
            ("judgment length", label, Group(slug, base.policy, base.genrm, base.what, tuple(extra)), args.gpus)
        )
    for gpus in args.sweep_gpus:
        if gpus != args.gpus:
            points.append(("cluster", f"{gpus} GPUs", Group(f"gpus-{gpus}", base.policy, base.genrm, base.what), gpus))
    points = [p for p in points if AXES[p[0]] in args.axes]
    results: list[dict[str, Any]] = []
    for axis, label, group, gpus in points:
        g = bench(group, gpus, args)
        g.update(sweep=axis, point=label)
        results.append(g)
        save(results)
        print(f"  {axis} {label}: {speedups(g)}", flush=True)
    return results


def sweep_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    return [r for g in points for r in rows(g, f"{g['sweep']}: {g['point']}")]


def code() -> str:
    """The commit the runs used, ``-dirty`` when the working tree differs from it."""
    cmd = ["git", "describe", "--always", "--dirty"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def report_text(report: dict[str, Any]) -> tuple[list[list[str]], list[str], str, str]:
    """The table rows, the notes, the title and the label of a report."""
    if "points" in report:
        items = report["points"]
        notes = [f"{g['sweep']} {g['point']}: {speedups(g)}" for g in items]
        gpus = report["settings"]["gpus"]
        title = f"dense-7b sensitivity (base {gpus} GPUs): tail, judge size, judgment length, cluster size"
        return sweep_rows(items), notes, title, "point"
    items = report["groups"]
    notes = [f"{g['name']} ({g['policy']} + {g['genrm']} judge): {speedups(g)}" for g in items]
    notes += [f"{g['name']}: {line}" for g in items if (line := gap(g))]
    title = f"{report['settings']['gpus']} x H100: steady samples/s by mode and the ideal"
    return [r for g in items for r in rows(g)], notes, title, "name"


def rerender(path: Path, out: Path | None) -> None:
    """``--rerender``: the runs of a report, their ideals and bounds recomputed, written again."""
    try:
        report = json.loads(path.read_text())
        key = "points" if "points" in report else "groups"
        items = report[key]
        for g in items:
            g["ideal"] = ideal(g["overrides"]).to_dict()
            if "ideals" in g:
                g["ideals"] = {tp: ideal(with_tp(g["overrides"], int(tp))).to_dict() for tp in g["ideals"]}
        report[key] = [derive(g) for g in items]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--rerender: {path} is not a report of this script ({type(e).__name__}: {e})") from None
    report["rerendered"] = {"code": code(), "machine": machine(list(os.getloadavg()))}
    table, notes, title, label = report_text(report)
    again = "".join(f"{', '.join(u['modes'])} again at {u['code']}; " for u in report.get("updates", []))
    notes.append(f"wall time {report.get('wall_s', 0.0) / 60:.1f} min (runs at {report.get('code', '?')}; {again}"
                 f"ideals and bounds at {report['rerendered']['code']})")  # fmt: skip
    show(report, table, notes, label)
    write_all(out or path.with_suffix(""), report, table, notes, title, label)


def update(args: argparse.Namespace) -> None:
    """``--update``: ``--modes`` of the report's groups run again (those named by ``--groups``), the other
    modes' runs kept, the report written again with both codes said."""
    try:
        report = json.loads(args.update.read_text())
        items = report["groups"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--update: {args.update} is not a report of this script ({type(e).__name__}: {e})") from None
    for k in ("steps", "search_steps", "search_levels", "search_budget"):
        setattr(args, k, report.get("settings", {}).get(k, getattr(args, k)))  # the runs kept were made so
    t0 = time.perf_counter()
    for i, g in enumerate(items):
        if g["name"] in args.groups and g["name"] in GROUPS:
            items[i] = bench(GROUPS[g["name"]], g["gpus"], args, kept=g)
    report.setdefault("updates", []).append({"code": code(), "modes": args.modes, "wall_s": time.perf_counter() - t0,
                                             "machine": machine(list(os.getloadavg()))})  # fmt: skip
    table, notes, title, label = report_text(report)
    notes.append(
        f"wall time {report.get('wall_s', 0.0) / 60:.1f} min (runs at {report.get('code', '?')}; "
        + "; ".join(f"{', '.join(u['modes'])} again at {u['code']}" for u in report["updates"])
        + ")"
    )
    show(report, table, notes, label)
    write_all(args.out or args.update.with_suffix(""), report, table, notes, title, label)


def show(report: dict[str, Any], table: list[list[str]], notes: list[str], label: str) -> None:
    print(text_table(table))
    print("\n".join(notes))
    print(f"\n{SPENT_TITLE}")
    print(text_table(spent_rows(report.get("groups") or report["points"], label), SPENT_HEAD))


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--tp", type=int, choices=TPS,
                   help="GPUs per instance for every group and mode (default: each mode at its fastest)")  # fmt: skip
    p.add_argument("--steps", type=int, default=8, help="steps per measured run (the first is left out)")
    p.add_argument("--search-steps", type=int, default=4, help="steps per run of the split search")
    p.add_argument("--search-levels", type=int, default=3, help="halvings of the compass search's spacing")
    p.add_argument("--search-budget", type=int, default=24, help="most runs of the split search per size")
    p.add_argument("--timeout", type=float, default=1800.0, help="wall seconds one run may take")
    p.add_argument("--quick", action="store_true", help="smoke run: 32 GPUs, 3 steps, a short search")
    p.add_argument("--sweep", action="store_true", help="the sensitivity sweep of dense-7b instead of the groups")
    p.add_argument("--sweep-gpus", type=int, nargs="+", default=[32, 64, 128, 512, 1024])
    p.add_argument("--axes", nargs="+", default=list(AXES.values()), choices=list(AXES.values()),
                   help="the sweep's axes to run (default: all)")  # fmt: skip
    p.add_argument("--runs", type=Path, help="keep the measured runs' directories under this folder")
    p.add_argument("--out", type=Path, help="path prefix of the reports (default benchmarks/results/paper[_sweep])")
    p.add_argument("--update", type=Path, metavar="JSON",
                   help="run only --modes of a report's groups (those of --groups) again and write it with the "
                        "other modes' runs kept: a change that moves one mode is re-measured alone")  # fmt: skip
    p.add_argument("--modes", nargs="+", default=["shiftable"], choices=list(MODES),
                   help="the modes --update runs again (default: shiftable)")  # fmt: skip
    p.add_argument("--rerender", type=Path, metavar="JSON",
                   help="no runs: recompute the ideals and bounds of a report's groups or points with this code and "
                        "write its table and chart again (its runs kept as they are)")  # fmt: skip
    args = p.parse_args()
    if args.rerender:
        rerender(args.rerender, args.out)
        return
    if args.update:
        update(args)
        return
    if args.quick:
        args.gpus, args.steps, args.search_steps, args.search_budget = 32, 3, 3, 7
        args.sweep_gpus = [64]
    name = "paper_sweep" if args.sweep else "paper"
    prefix = args.out or (Path(tempfile.gettempdir()) / "pivotrl-paper-quick" if args.quick else RESULTS) / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    keys = ("gpus", "tp", "steps", "search_steps", "search_levels", "search_budget", "sweep_gpus", "axes")
    report: dict[str, Any] = {"machine": machine(list(os.getloadavg())), "config": str(EXAMPLE), "code": code(),
                              "settings": {k: getattr(args, k) for k in keys}}  # fmt: skip
    t0 = time.perf_counter()
    if args.sweep:

        def save(points: list[dict[str, Any]]) -> None:  # after each point: a long sweep keeps what it did
            write_report(prefix.with_suffix(".json"), {**report, "points": points, "partial": True})

        report["points"] = sweep(args, save)
    else:
        report["groups"] = [bench(GROUPS[name], args.gpus, args) for name in args.groups]
    report["wall_s"] = wall = time.perf_counter() - t0
    table, notes, title, label = report_text(report)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    notes.append(f"wall time {wall / 60:.1f} min")
    show(report, table, notes, label)
    write_all(prefix, report, table, notes, title, label)


if __name__ == "__main__":
    main()
