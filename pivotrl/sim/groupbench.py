"""A model group in every mode, each at its fastest instance size: the runs behind ``benchmarks/paper.py``.

Every run is ``pivotrl simulate`` of the group's job in its own process (``versus.simulate_apart``), read
through the steady window (``pivotrl.sim.steady``), at instance sizes the runtime builds (``unbuilt`` says why
each other size is not run). Colocated (deployed and strong) and shiftable run at each instance size from the
highest floor bound down, a size skipped when its bound cannot beat the mode's best run
so far (``versus.best_size``). The disaggregated baseline's split is searched (``versus.search_split``) on
short runs at each size worth trying, the size whose search found the shortest step kept, and its best split
run again at full length.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.sim.groupreport import derive, rate_text
from pivotrl.sim.groups import Group, instance_sizes, job_overrides, unbuilt_sizes
from pivotrl.sim.ideal import INSTANCE_SIZES, IdealStep
from pivotrl.sim.versus import MODES, Split, best_size, mode_overrides, search_split, simulate_apart, split_text

SAY = functools.partial(print, flush=True)  # progress lines as they come
Simulate = Callable[[Path, list[str], float, Path | None], dict[str, Any]]  # (config, overrides, timeout, keep)


@dataclass(frozen=True, slots=True)
class Settings:
    """How a group is run: steps of a measured run and of a search run, the search's halvings and runs per
    size, wall seconds a run may take, one instance size for all (None: each mode at its fastest), and where
    the measured runs' directories are kept (None: nowhere)."""

    steps: int = 8
    search_steps: int = 4
    search_levels: int = 3
    search_budget: int = 24
    timeout: float = 1800.0
    tp: int | None = None
    runs: Path | None = None


def bench(
    group: Group,
    gpus: int,
    settings: Settings,
    modes: Sequence[str] = MODES,
    kept: dict[str, Any] | None = None,
    simulate: Simulate = simulate_apart,
    say: Callable[[str], None] = SAY,
) -> dict[str, Any]:
    """The group in each of ``modes``, each at its best instance size (``settings.tp``: that one for all); with
    ``kept`` (the group from an earlier report) the runs of its other modes are kept as they are."""
    t0 = time.perf_counter()
    wanted = set(modes)
    tps = (settings.tp,) if settings.tp else INSTANCE_SIZES
    sizes = instance_sizes(group, gpus, tps)  # (only the layouts the runtime builds: ``unbuilt`` says why not)
    tp0 = max(sizes, key=lambda tp: sizes[tp].samples_per_s)  # the highest ideal: the table's ideal row
    caps = {tp: i.floor_samples_per_s for tp, i in sizes.items()}
    keep = (lambda mode: settings.runs / group.name / mode) if settings.runs else (lambda mode: None)
    say(f"{group.name}: {group.policy} + {group.genrm} judge, {gpus} GPUs in instances of "
        f"{'/'.join(map(str, sizes))}; ideal {sizes[tp0].samples_per_s:.1f} samples/s (TP{tp0}), floor bound "
        + ", ".join(f"TP{tp} {cap:.1f}" for tp, cap in caps.items()))  # fmt: skip
    rows: dict[str, dict[str, Any]] = {m: r for m, r in (kept or {}).get("modes", {}).items() if m not in wanted}
    for mode in ("deployed", "colocated", "shiftable"):
        if mode not in wanted:
            continue
        runs: dict[int, dict[str, Any]] = {}

        def run(tp: int, mode: str = mode, runs: dict[int, dict[str, Any]] = runs) -> float:
            where = keep(f"{mode}-tp{tp}")  # (each size's run kept apart; the chosen one is renamed below)
            overrides = [*job_overrides(group, gpus, tp), *mode_overrides(mode), f"steps={settings.steps}"]
            r = runs[tp] = simulate(group.config, overrides, settings.timeout, where)
            say(f"  {mode} TP{tp}: {rate_text(r)} ({r['wall_s']:.0f} s)")
            return r.get("samples_per_s", 0.0)

        tp, tried = best_size(caps, run)
        chosen = tp if tp is not None else next(iter(runs))  # (every run failed: the first one's error)
        if settings.runs:  # the chosen size's run is the mode's; the others go
            for size in runs:
                src = keep(f"{mode}-tp{size}")
                if size == tp:
                    shutil.rmtree(keep(mode), ignore_errors=True)
                    src.rename(keep(mode))
                else:
                    shutil.rmtree(src, ignore_errors=True)
        rows[mode] = {**runs[chosen], "instance_gpus": chosen, "sizes": tried}

    if "disaggregated" in wanted:
        rows["disaggregated"] = disaggregated(group, gpus, settings, sizes, caps, keep, simulate, say)
    g = {
        "name": group.name,
        "what": group.what,
        "policy": group.policy,
        "judge": group.genrm,
        "gpus": gpus,
        "config": str(group.config),
        "instance_gpus": tp0,
        "devices": gpus // tp0,
        "overrides": job_overrides(group, gpus, tp0),
        "ideal": sizes[tp0].to_dict(),
        "ideals": {str(tp): i.to_dict() for tp, i in sizes.items()},
        "unbuilt": unbuilt_sizes(group, gpus, tps),
        "modes": {m: rows[m] for m in MODES if m in rows},
    }
    return {**derive(g), "wall_s": time.perf_counter() - t0}


def disaggregated(
    group: Group,
    gpus: int,
    settings: Settings,
    sizes: dict[int, IdealStep],
    caps: dict[int, float],
    keep: Callable[[str], Path | None],
    simulate: Simulate,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The best static split: searched at each instance size worth trying, then run at the best one."""
    searched: dict[int, tuple[Split, list[tuple[Split, float]]]] = {}

    def search_at(tp: int) -> float:
        devices = gpus // tp

        def evaluate(split: Split) -> float:
            overrides = [*job_overrides(group, gpus, tp), "mode=disaggregated", f"split={split_text(split)}",
                         f"steps={settings.search_steps}"]  # fmt: skip
            r = simulate(group.config, overrides, settings.timeout, None)
            say(f"  search TP{tp} {split_text(split)}: {rate_text(r)} ({r['wall_s']:.0f} s)")
            return r.get("step_seconds", math.inf)

        seed = sizes[tp].split(devices)
        searched[tp] = search_split(evaluate, devices, (seed["rollout"], seed["judge"], seed["train"]),
                                    settings.search_levels, settings.search_budget)  # fmt: skip
        step_s = min(v for _, v in searched[tp][1])
        return sizes[tp].samples / step_s if step_s < math.inf else 0.0

    tp, tried = best_size(caps, search_at)
    tp = tp if tp is not None else next(iter(searched))
    split = searched[tp][0]
    overrides = [*job_overrides(group, gpus, tp), "mode=disaggregated", f"split={split_text(split)}",
                 f"steps={settings.steps}"]  # fmt: skip
    dis = simulate(group.config, overrides, settings.timeout, keep("disaggregated"))
    dis.update(split=split_text(split), instance_gpus=tp, sizes=tried)
    dis["search"] = [{"tp": t, "split": split_text(s), "step_seconds": v} for t in searched for s, v in searched[t][1]]
    say(f"  disaggregated TP{tp} {dis['split']}: {rate_text(dis)} after {len(dis['search'])} search runs")
    return dis
