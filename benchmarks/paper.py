"""Shiftable against its baselines on cluster-scale jobs, next to the ideal throughput.

Six model groups (policy + generative judge) on 128 simulated H100s, each a
job file under ``examples/paper/`` (``pivotrl.sim.groups``), run through
``pivotrl.sim.versus`` (``pivotrl.sim.groupbench``) in colocated (deployed and
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

Tensor parallelism: only layouts the runtime builds. Every instance is
``tensor_parallel`` GPUs of one 8-GPU node, one engine a role over all of them,
policy and judge at the same size (the runtime has one ``tensor_parallel`` for
the job). A size a model's attention heads, KV heads or MLP width cannot be cut
in evenly (vLLM's rule, ``pivotrl.resolve.check_tensor_parallel``: a 7B's 28
heads rule out 8) is not run, and the notes say so (``unbuilt`` in the JSON).
Engines smaller than the instance (``sim.rollout_engine_gpus``,
``sim.judge_engine_gpus``) and the elastic bound (``sim.elastic_engines``) are
not layouts the runtime builds: they are not in this table (``layouts.py``
measures them beside it: they move no mode by more than 5%). Each mode runs
at the power of two from 1 to 8 where it is fastest, measured (``--tp``
forces one for all): a smaller
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
floor's), ``unbuilt`` (the sizes not run, and why),
``speedup_vs_deployed_colocated``, ``speedup_vs_colocated``,
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
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import machine, write_report

from pivotrl.errors import UserError
from pivotrl.sim.groupbench import Settings, bench
from pivotrl.sim.groupreport import (
    SPENT_HEAD,
    Unbuilt,
    bound,
    derive,
    drop_unbuilt,
    md_table,
    mode_tp,
    modes_of,
    report_text,
    rerender_note,
    speedups,
    spent_rows,
    text_table,
    update_note,
)
from pivotrl.sim.groups import AXES, BASE, GROUPS, ideal, short, sweep_points, with_tp
from pivotrl.sim.ideal import INSTANCE_SIZES
from pivotrl.sim.versus import LABELS, MODES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
TPS = INSTANCE_SIZES


def settings(args: argparse.Namespace) -> Settings:
    return Settings(args.steps, args.search_steps, args.search_levels, args.search_budget, args.timeout, args.tp,
                    args.runs)  # fmt: skip


# -- reports --------------------------------------------------------------------------------

ASSUMPTIONS = """\
- Simulated with `pivotrl simulate` (the real controller, scheduler and planner on a virtual clock) on H100 SXM
  (989 TFLOP/s bf16 dense, 3.35 TB/s HBM, 80 GB, PCIe Gen5 to the host, NVLink in 8-GPU nodes, 50 GB/s per GPU
  between nodes); costs from `RooflineCosts` (datasheet peaks times the efficiencies in `pivotrl/sim/costs.py`).
- Workload `examples/sim128.yaml`: 512 prompts x 16 responses a step, 512-token prompts, lognormal response lengths
  (median 1200, sigma 0.9, cap 8192), judge prompt = prompt + response + 256 tokens, 512-token judgments,
  at most 256 sequences per engine.
- Only layouts the runtime builds: an instance is `tensor_parallel` GPUs of one 8-GPU node, one engine a role over
  all of them, policy and judge at the same size; a size a model's heads, KV heads or MLP width cannot be cut in
  (vLLM's rule, `pivotrl.resolve.check_tensor_parallel`) is not run (the notes name each). No engines smaller than
  the instance, no elastic bound (`benchmarks/layouts.py` has those).
- One tensor-parallel size for every instance of a run (the job's `tensor_parallel`), chosen per mode as
  the one where the mode is fastest (measured at 1, 2, 4 and 8 GPUs where the models fit and cut, a size skipped
  when its floor bound cannot beat the best run so far; the disaggregated split searched at each size). The ideal
  row is at the size with the highest ideal throughput; the bound at the size with the lowest floor.
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
    return f"{g[label]}\n{short(g['policy'])} + {short(g['judge'])} judge, TP {sizes}"


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

# -- the sensitivity sweep ------------------------------------------------------------------


def sweep(args: argparse.Namespace, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every sweep point benched like a group; ``save`` gets the points so far after each one."""
    results: list[dict[str, Any]] = []
    for axis, label, group, gpus in sweep_points(args.gpus, args.sweep_gpus, tuple(args.axes)):
        g = bench(group, gpus, settings(args))
        g.update(sweep=axis, point=label)
        results.append(g)
        save(results)
        print(f"  {axis} {label}: {speedups(g)}", flush=True)
    return results


def code() -> str:
    """The commit the runs used, ``-dirty`` when the working tree differs from it."""
    cmd = ["git", "describe", "--always", "--dirty"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def rerender(path: Path, out: Path | None) -> None:
    """``--rerender``: the runs of a report, their ideals and bounds recomputed, written again; the runs at a size
    this code builds no layout at are dropped (a mode that was chosen there must run again)."""
    try:
        report = json.loads(path.read_text())
        key = "points" if "points" in report else "groups"
        items = report[key]
        for g in items:
            config = g.get("config", BASE)  # (older reports: overrides of examples/sim128.yaml)
            g["ideal"] = ideal(config, g["overrides"]).to_dict()
            if "ideals" in g:  # (a size this code builds no layout at: its runs go, the report says why)
                unbuilt: dict[str, str] = {}
                for tp in g["ideals"]:
                    try:
                        g["ideals"][tp] = ideal(config, with_tp(g["overrides"], int(tp))).to_dict()
                    except UserError as e:
                        unbuilt[tp] = str(e)
                drop_unbuilt(g, unbuilt)
        report[key] = [derive(g) for g in items]
    except UserError as e:
        raise SystemExit(f"--rerender: {e}") from None
    except Unbuilt as e:
        raise SystemExit(f"--rerender: {e} (--update, its --groups and --modes)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--rerender: {path} is not a report of this script ({type(e).__name__}: {e})") from None
    report["rerendered"] = {"code": code(), "machine": machine(list(os.getloadavg()))}
    table, notes, title, label = report_text(report)
    notes.append(rerender_note(report))
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
            items[i] = bench(GROUPS[g["name"]], g["gpus"], settings(args), args.modes, kept=g)
    report.setdefault("updates", []).append({"code": code(), "modes": args.modes, "wall_s": time.perf_counter() - t0,
                                             "machine": machine(list(os.getloadavg()))})  # fmt: skip
    table, notes, title, label = report_text(report)
    notes.append(update_note(report))
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
                        "write its table and chart again (its runs kept as they are, but those at a size this code "
                        "builds no layout at)")  # fmt: skip
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
    report: dict[str, Any] = {"machine": machine(list(os.getloadavg())), "config": str(BASE), "code": code(),
                              "settings": {k: getattr(args, k) for k in keys}}  # fmt: skip
    t0 = time.perf_counter()
    if args.sweep:

        def save(points: list[dict[str, Any]]) -> None:  # after each point: a long sweep keeps what it did
            write_report(prefix.with_suffix(".json"), {**report, "points": points, "partial": True})

        report["points"] = sweep(args, save)
    else:
        report["groups"] = [bench(GROUPS[name], args.gpus, settings(args)) for name in args.groups]
    report["wall_s"] = wall = time.perf_counter() - t0
    table, notes, title, label = report_text(report)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    notes.append(f"wall time {wall / 60:.1f} min")
    show(report, table, notes, label)
    write_all(prefix, report, table, notes, title, label)


if __name__ == "__main__":
    main()
