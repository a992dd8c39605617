"""A job simulated in shiftable mode and in the modes users run instead, side by side.

``pivotrl simulate CONFIG --out DIR --versus`` answers "what would shiftable do for my job": it runs the
job, as configured, in each mode it names, on the same modeled cluster, and prints each mode's steady
throughput, its share of the step floor no on-policy schedule passes (``pivotrl.sim.ideal``), and
shiftable's speedup over it. The baselines:

    deployed       colocated as today's frameworks (verl, NeMo-RL, slime) run it: every phase switch at
                   its published cost (``DeployedCosts``, each number with its source), no sequence moved
                   between engines within a step
    colocated      the strongest colocated schedule pivotrl models: its own ~1-2 s shifts, the rollout
                   rebalanced in flight
    disaggregated  a static split of the devices: the job's ``split`` if it names one, else the best a
                   compass search finds (``search_split``: a coarse grid about the ideal's split, then
                   moves of fewer and fewer devices between two roles), each candidate a short run

Each mode runs at the instance size the job names, or with ``sizes`` at each of them from the highest floor
down, skipping a size whose floor is below the best run so far (``best_size``), and keeps its fastest. Its
run directory is ``DIR/<mode>``; ``DIR/versus.json`` holds the table. Speed is the simulator's (modeled
GPUs on a virtual clock): as good as the cost model, which ``benchmarks/fidelity.py`` checks against
real runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pivotrl.config import ConfigError, JobConfig, load_config
from pivotrl.errors import UserError
from pivotrl.sim.steady import ROLES, steady_window

SYNC_MODES = ("deployed", "colocated", "disaggregated", "shiftable")  # on-policy: what --versus runs unless told
# overlapping steps (max_staleness = k): the asynchronous schedules of other frameworks (the deployed colocated
# one a step off-policy; the static split, rollout never waiting for the update) and shiftable's own
ASYNC_MODES = {"deployed-k1": 1, "disaggregated-k1": 1, "shiftable-k1": 1, "shiftable-k2": 2}
MODES = (*SYNC_MODES, *ASYNC_MODES)
# the colocated baseline as today's frameworks run it: each phase switch at its published cost (engines put
# to sleep and woken, the policy's weights synced into the rollout engine, the trainer's state offloaded:
# ``DeployedCosts``, every number with its source), no sequence moved between engines within a step
DEPLOYED = ("mode=colocated", "sim.costs=deployed", "rollout.rebalance=false")
LABELS = {"deployed": "colocated, deployed", "colocated": "colocated, strong", "disaggregated": "disaggregated",
          "shiftable": "shiftable", "deployed-k1": "colocated, deployed, k=1", "disaggregated-k1": "disaggregated, k=1",
          "shiftable-k1": "shiftable, k=1", "shiftable-k2": "shiftable, k=2"}  # fmt: skip
Split = tuple[int, int, int]  # rollout, genrm, train devices (``ROLES``' order, the config's names)
SEARCH_BUDGET = 12  # runs of the split search per instance size
SEARCH_STEPS = 3  # steps of each (the first is left out of its step time)


def base_mode(mode: str) -> str:
    """The schedule of ``mode`` without its overlap: ``disaggregated-k1`` is ``disaggregated``'s."""
    return mode.partition("-k")[0]


def mode_overrides(mode: str) -> list[str]:
    """The overrides that run a job in ``mode`` (one of ``MODES``)."""
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}, expected one of {', '.join(MODES)}")
    base = base_mode(mode)
    overlap = [f"max_staleness={ASYNC_MODES[mode]}"] if mode in ASYNC_MODES else []
    return [*(DEPLOYED if base == "deployed" else [f"mode={base}"]), *overlap]


def best_size(caps: dict[int, float], run: Callable[[int], float]) -> tuple[int | None, list[dict[str, Any]]]:
    """The instance size where ``run`` (a mode at that size: its samples/s, 0 when it failed) is fastest.
    Sizes are tried from the highest floor bound (``caps``, samples/s) down; one whose bound is no better
    than the best run so far is skipped (no run there can beat it). Every size, run or skipped, in the list."""
    best, best_rate, tried = None, 0.0, []
    for tp in sorted(caps, key=lambda tp: -caps[tp]):
        cap = caps[tp]
        if best is not None and cap <= best_rate:
            tried.append({"tp": tp, "skipped": f"floor bound {cap:.1f} samples/s <= {best_rate:.1f}"})
            continue
        rate = run(tp)
        tried.append({"tp": tp, "samples_per_s": rate})
        if rate > best_rate:
            best, best_rate = tp, rate
    return best, tried


# -- the split search -----------------------------------------------------------------------


def _valid(split: Split, devices: int) -> bool:
    return min(split) >= 1 and sum(split) == devices


def _move(split: Split, src: int, dst: int, n: int) -> Split:
    r, g, t = (k - n * (i == src) + n * (i == dst) for i, k in enumerate(split))
    return r, g, t


def search_split(
    evaluate: Callable[[Split], float], devices: int, seed: Split, levels: int = 3, budget: int = 24
) -> tuple[Split, list[tuple[Split, float]]]:
    """The split with the lowest ``evaluate`` (a steady step time; ``inf`` when a run failed) found by
    a coarse grid then a compass search (module docstring); every split evaluated, in order."""
    if not _valid(seed, devices):
        raise ValueError(f"seed: {seed} is not a split of {devices} devices with one per role")
    tried: dict[Split, float] = {}

    def run(split: Split) -> float:
        if split not in tried and len(tried) < budget:
            tried[split] = evaluate(split)
        return tried.get(split, math.inf)

    def best_of(points: list[Split], best: Split) -> Split:
        for p in points:
            if _valid(p, devices) and run(p) < run(best):
                best = p
        return best

    best, spacing = seed, max(1, round(devices / 8))
    run(best)
    while True:  # coarse: the 3x3 grid of (genrm, train) counts, re-centred while the best moves
        _, g, t = best
        grid = [(devices - g - t - (i + j) * spacing, g + i * spacing, t + j * spacing)
                for i in (-1, 0, 1) for j in (-1, 0, 1)]  # fmt: skip
        before, best = best, best_of(grid, best)
        if best == before or len(tried) >= budget:
            break
    for _ in range(levels):  # refine: move `spacing` devices from one role to another
        spacing //= 2
        if spacing < 1:
            break
        while len(tried) < budget:
            moves = [_move(best, src, dst, spacing) for src, dst in itertools.permutations(range(3), 2)]
            before, best = best, best_of(moves, best)
            if best == before:
                break
    return best, list(tried.items())


def split_text(split: Split) -> str:
    return ",".join(f"{r}:{n}" for r, n in zip(ROLES, split, strict=True))


def _ideal_split(cfg: JobConfig) -> Split:
    """The split the job's ideal step suggests, one device a role at least: the search's start."""
    from pivotrl.sim.ideal import ideal_for_job

    devices = cfg.sim.gpus // cfg.sim.instance_gpus
    if devices < 3:
        raise UserError(f"{devices} instance(s) of {cfg.sim.instance_gpus} GPU(s) cannot hold one a role; a static "
                        "split needs 3 or more (more sim.gpus, or a smaller tensor_parallel)")  # fmt: skip
    s = ideal_for_job(cfg).split(devices)
    return s["rollout"], s["judge"], s["train"]


# -- the runs -------------------------------------------------------------------------------


def _steady(run_dir: Path, summary: dict[str, Any], cfg: JobConfig) -> dict[str, Any]:
    """A run's steady numbers (``steady_window``: its throughput after its first step, busy shares, shifts) and
    its floor. Its step time is the one its rate implies (a step's samples over it), so that the table's step
    time and throughput say one thing."""
    rate, ideal = summary["steady_samples_per_s"], summary["sim"]["ideal"]
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return {
        **steady_window(run_dir),
        "step_seconds": samples / rate if rate > 0 else math.inf,
        "instance_gpus": summary["sim"]["instance_gpus"],
        "floor_samples_per_s": ideal["floor_samples_per_s"],
        "floor_seconds": ideal["floor_seconds"],
    }


def run_apart(config: str | Path, overrides: Sequence[str], out: Path, timeout: float) -> tuple[float, str | None]:
    """``pivotrl simulate`` in its own process (a run that hangs or exhausts memory stops there, not here):
    its wall seconds, and the error that stopped it (the last line it printed, or the timeout), None if it
    finished."""
    cmd = [sys.executable, "-m", "pivotrl.cli", "simulate", str(config), *overrides, "--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, f"stopped after {timeout:.0f} s"
    error = (
        None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    )
    return time.perf_counter() - t0, error


def simulate_apart(
    config: str | Path, overrides: Sequence[str], timeout: float, keep: Path | None = None
) -> dict[str, Any]:
    """One run in its own process (``run_apart``): its steady numbers (``steady_window``) and wall seconds, or
    the error that stopped it. ``keep``: where its run directory goes (else it is removed)."""
    out = Path(tempfile.mkdtemp(prefix="pivotrl-run-"))
    wall, error = run_apart(config, overrides, out, timeout)
    row: dict[str, Any] = {"wall_s": wall}
    if error:
        row["error"] = error
    else:
        row.update(steady_window(out))
    if keep is not None and not error:
        shutil.rmtree(keep, ignore_errors=True)
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(out), keep)
    shutil.rmtree(out, ignore_errors=True)
    return row


class Versus:
    """The runs of one ``--versus``: the job's config and overrides, and where to say what ran."""

    def __init__(self, config: str | Path, overrides: Sequence[str], say: Callable[[str], None]) -> None:
        named = [o for o in overrides if o.split("=", 1)[0].strip() == "mode"]
        if named:
            raise UserError(f"--versus runs the job in each mode it names: leave {named[0]!r} out of the overrides")
        self.config, self.overrides, self.say = config, list(overrides), say
        self.job = load_config(config, self.overrides, simulated=True)  # (a bad override stops here, before any run)
        if self.job.sim.costs == "deployed":
            raise UserError("--versus prices the deployed baseline itself (sim.costs=deployed for that mode only): "
                            "leave sim.costs at roofline, the default, or a measured-costs file")  # fmt: skip

    def cfg(self, mode: str, tp: int, *extra: str) -> JobConfig:
        split = [] if base_mode(mode) == "disaggregated" else ["split="]  # (a split names devices of one size)
        return load_config(self.config, [*self.overrides, *mode_overrides(mode), *split, f"tensor_parallel={tp}",
                                         *extra], simulated=True)  # fmt: skip

    def simulate(self, cfg: JobConfig, run_dir: Path) -> dict[str, Any]:
        from pivotrl.sim.run import run_simulation

        t0 = time.perf_counter()
        quiet = logging.getLogger("pivotrl")  # (a run's "run written to" line: this prints its own)
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            summary = run_simulation(cfg, run_dir)
        finally:
            quiet.setLevel(level)
        return {**_steady(run_dir, summary, cfg), "wall_s": time.perf_counter() - t0}

    def search(
        self, tp: int, budget: int, steps: int, mode: str = "disaggregated"
    ) -> tuple[Split, list[dict[str, Any]]]:
        """The best static split at ``tp`` GPUs an instance for ``mode`` (a static split, maybe with overlapping
        steps), each candidate a run of ``steps`` steps."""
        seed = _ideal_split(self.cfg("colocated", tp))
        scratch = Path(tempfile.mkdtemp(prefix="pivotrl-versus-"))
        runs: list[dict[str, Any]] = []

        def evaluate(split: Split) -> float:
            run_dir = scratch / f"{len(runs)}"
            try:
                r = self.simulate(self.cfg(mode, tp, f"split={split_text(split)}", f"steps={steps}"), run_dir)
            except (UserError, ConfigError) as e:  # (a split whose train devices cannot hold the trainer, say)
                runs.append({"split": split_text(split), "error": str(e)})
                self.say(f"  search TP{tp} {split_text(split)}: {e}")
                return math.inf
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
            runs.append({"split": split_text(split), "step_seconds": r["step_seconds"]})
            self.say(f"  search TP{tp} {split_text(split)}: {r['samples_per_s']:.1f} samples/s")
            return r["step_seconds"]

        try:
            best, _ = search_split(evaluate, sum(seed), seed, budget=budget)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return best, runs


def versus(
    config: str | Path,
    overrides: Sequence[str],
    out: str | Path,
    modes: Sequence[str] = SYNC_MODES,
    sizes: Sequence[int] = (),
    search_budget: int = SEARCH_BUDGET,
    search_steps: int = SEARCH_STEPS,
    seeds: int = 1,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Simulate the job of ``config`` and ``overrides`` in each of ``modes``, each at its fastest of ``sizes``
    (GPUs an instance; empty: the job's own), into ``out/<mode>``; the report, also written to
    ``out/versus.json``. With ``seeds`` above 1 each mode runs again at its size (and split) with the
    job's seed + 1, + 2, ... (``out/<mode>-seed<N>``), and its figures are the runs' means."""
    from pivotrl.sim.ideal import ideal_for_job
    from pivotrl.sim.run import concrete_instances

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"--versus: got {' '.join(unknown) or 'no mode'}, expected some of {', '.join(MODES)}")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (runs of each mode, one a seed), got {seeds}")
    if search_budget < 1 or search_steps < 2:
        raise UserError(f"--search-budget must be >= 1 (got {search_budget}) and --search-steps >= 2 "
                        f"(got {search_steps}: the first step is left out of a run's step time)")  # fmt: skip
    out = Path(out)
    v = Versus(config, overrides, say)
    if any(base_mode(m) == "deployed" for m in modes) and v.job.sim.costs != "roofline":
        raise UserError(f"--versus deployed: the deployed baseline is priced on the modeled GPUs, this job's costs "
                        f"are measured (sim.costs={v.job.sim.costs}); leave deployed out, or compare on the "
                        "modeled GPUs (sim.costs=roofline)")  # fmt: skip
    sizes = list(dict.fromkeys(sizes)) or [concrete_instances(v.job).sim.instance_gpus]
    floors: dict[int, float] = {}  # samples/s no schedule passes, per size the job fits at
    for tp in sizes:
        try:
            cfg = v.cfg("colocated", tp)
        except ConfigError as e:  # (a size the cluster does not divide into, say)
            raise UserError(f"--sizes {tp}: {e}") from None
        try:
            floors[tp] = ideal_for_job(cfg).floor_samples_per_s
        except UserError as e:  # (the models do not fit on instances of this size)
            if len(sizes) == 1:
                raise
            say(f"  TP{tp}: {e}")
    if not floors:
        raise UserError(f"--sizes {' '.join(map(str, sizes))}: the job fits at none of them")
    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": str(config), "overrides": list(overrides), "sizes": sorted(floors),
                              "floor_samples_per_s": max(floors.values()),
                              "floor_instance_gpus": max(floors, key=lambda tp: floors[tp]), "modes": {}}  # fmt: skip
    split_given = v.job.split if v.job.mode == "disaggregated" or any(
        o.split("=", 1)[0].strip() == "split" for o in overrides) else ""  # fmt: skip
    for mode in [m for m in MODES if m in modes]:
        runs: dict[int, dict[str, Any]] = {}
        searched: dict[int, tuple[Split, list[dict[str, Any]]]] = {}

        def run(tp: int, mode: str = mode, runs: dict = runs, searched: dict = searched) -> float:
            extra: list[str] = []
            run_dir = out / f"{mode}-tp{tp}"
            try:
                if base_mode(mode) == "disaggregated":
                    if split_given:
                        extra = [f"split={split_given}"]
                    else:
                        searched[tp] = v.search(tp, search_budget, search_steps, mode)
                        extra = [f"split={split_text(searched[tp][0])}"]
                r = runs[tp] = v.simulate(v.cfg(mode, tp, *extra), run_dir)
            except (UserError, ConfigError) as e:  # (this mode at this size: the others may still run)
                runs[tp] = {"error": str(e)}
                shutil.rmtree(run_dir, ignore_errors=True)
                say(f"  {LABELS[mode]} TP{tp}: {e}")
                return 0.0
            if extra:
                r["split"] = extra[0].split("=", 1)[1]
            say(f"  {LABELS[mode]} TP{tp}: {r['samples_per_s']:.1f} samples/s ({r['wall_s']:.0f} s)")
            return r["samples_per_s"]

        tp, tried = best_size(floors, run)
        for size in runs:  # the fastest size's run is the mode's; the others go
            src = out / f"{mode}-tp{size}"
            if size == tp:
                src.rename(out / mode)
            else:
                shutil.rmtree(src, ignore_errors=True)
        if tp is None:
            report["modes"][mode] = {"error": next(iter(runs.values()))["error"], "sizes": tried}
            continue
        row = {**runs[tp], "run": str(out / mode), "sizes": tried,
               "floor_fraction": runs[tp]["samples_per_s"] / report["floor_samples_per_s"]}  # fmt: skip
        if tp in searched:
            row["search"] = searched[tp][1]
        if seeds > 1:
            _reseed(v, mode, tp, row, seeds, out, report["floor_samples_per_s"])
        report["modes"][mode] = row
    report["speedup"] = _speedups(report["modes"])
    report["wall_s"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)  # (where no mode ran, no run made it)
    (out / "versus.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _reseed(v: Versus, mode: str, tp: int, row: dict[str, Any], seeds: int, out: Path, floor: float) -> None:
    """``mode`` at ``tp`` (and its split) again with ``seeds - 1`` more seeds; ``row`` takes their means (its
    share of ``floor``, samples/s, too)."""
    extra = [f"split={row['split']}"] if row.get("split") else []
    runs = [{"seed": v.job.seed, "samples_per_s": row["samples_per_s"], "step_seconds": row["step_seconds"]}]
    for seed in range(v.job.seed + 1, v.job.seed + seeds):
        run_dir = out / f"{mode}-seed{seed}"
        try:
            r = v.simulate(v.cfg(mode, tp, *extra, f"seed={seed}"), run_dir)
        except (UserError, ConfigError) as e:
            shutil.rmtree(run_dir, ignore_errors=True)
            runs.append({"seed": seed, "error": str(e)})
            v.say(f"  {LABELS[mode]} TP{tp} seed {seed}: {e}")
            continue
        runs.append({"seed": seed, "samples_per_s": r["samples_per_s"], "step_seconds": r["step_seconds"]})
        v.say(f"  {LABELS[mode]} TP{tp} seed {seed}: {r['samples_per_s']:.1f} samples/s ({r['wall_s']:.0f} s)")
    ran = [r for r in runs if "error" not in r]
    rates = [r["samples_per_s"] for r in ran]
    row["seeds"] = runs
    row["samples_per_s_range"] = [min(rates), max(rates)]
    row["samples_per_s"] = sum(rates) / len(rates)
    row["step_seconds"] = sum(r["step_seconds"] for r in ran) / len(ran)
    row["floor_fraction"] = row["samples_per_s"] / floor


def _speedups(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Shiftable's throughput over each other mode's that ran: on-policy shiftable's over the on-policy modes,
    and over the overlapping ones the fastest shiftable that overlaps (each mode compared with its kind)."""

    def rate(m: str) -> float:
        return rows.get(m, {}).get("samples_per_s") or 0.0

    mine = rate("shiftable")
    overlapping = max((rate(m) for m in ASYNC_MODES if base_mode(m) == "shiftable"), default=0.0)
    out = {}
    for m, r in rows.items():
        ours = overlapping if m in ASYNC_MODES else mine
        if base_mode(m) != "shiftable" and ours and r.get("samples_per_s"):
            out[m] = ours / r["samples_per_s"]
    return out


def format_versus(report: dict[str, Any]) -> str:
    """The table a person reads: each mode's throughput, share of the floor, and shiftable's speedup over it."""
    head = ("mode", "GPUs an instance", "trainer", "samples/s", "step s", "of floor", "shiftable vs it",
            "any schedule vs it")  # fmt: skip
    table = []
    for mode, r in report["modes"].items():
        label = LABELS[mode] if not r.get("split") else "static split " + "/".join(
            x.split(":")[1] for x in r["split"].split(","))  # fmt: skip
        if r.get("split") and mode in ASYNC_MODES:
            label += f", k={ASYNC_MODES[mode]}"
        if "error" in r:
            table.append([label, "", "", "failed", "", "", "", ""])
            continue
        x = report["speedup"].get(mode)
        rate = f"{r['samples_per_s']:.1f}"
        if r.get("samples_per_s_range"):
            lo, hi = r["samples_per_s_range"]
            rate += f" ({lo:.1f}-{hi:.1f})"
        bounded = mode not in ASYNC_MODES  # (the floor bounds on-policy schedules: overlapping ones may pass it)
        table.append([label, str(r["instance_gpus"]), str(r.get("train_backend") or ""), rate,
                      f"{r['step_seconds']:.1f}", f"{r['floor_fraction']:.0%}", f"{x:.2f}x" if x else "",
                      f"<= {1 / r['floor_fraction']:.2f}x" if bounded else ""])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))  # fmt: skip
    floor = report["floor_samples_per_s"]
    for mode, r in report["modes"].items():
        if "error" in r:
            lines.append(f"{LABELS[mode]}: {r['error']}")
    tp = report["floor_instance_gpus"]
    lines.append(f"no on-policy schedule passes {floor:.1f} samples/s here (instances of {tp} GPU{'s' * (tp > 1)}; "
                 "simulated, as every figure above; a static split is rollout/judge/train instances)")  # fmt: skip
    if any(m in ASYNC_MODES for m in report["modes"]):
        lines.append(
            "k=N: steps overlap, samples at most N versions stale (max_staleness); an overlapping mode "
            "is compared with the fastest shiftable that overlaps, an on-policy one with on-policy shiftable"
        )
    return "\n".join(lines)
