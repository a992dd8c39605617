"""Engines inside an instance: the layouts ``benchmarks/layouts.py`` runs, and how it reads their runs.

A layout is (GPUs an instance, GPUs a rollout engine, GPUs a judge engine); with the elastic bound every decode
span runs on the engines that make it shortest. ``summarize`` compares, per mode, its best run of one engine an
instance with its best layout and its elastic bound.
"""

from __future__ import annotations

from typing import Any

from pivotrl.sim.groups import Group, job_overrides

Layout = tuple[int, int, int]  # (GPUs an instance, GPUs a rollout engine, GPUs a judge engine)


def overrides(group: Group, gpus: int, layout: Layout, elastic: bool = False) -> list[str]:
    tp, rollout, judge = layout
    out = [*job_overrides(group, gpus, tp), f"sim.rollout_engine_gpus={rollout}", f"sim.judge_engine_gpus={judge}"]
    return [*out, "sim.elastic_engines=true"] if elastic else out


def label(layout: Layout, elastic: bool = False) -> str:
    tp, rollout, judge = layout
    return f"TP{tp} elastic" if elastic else f"TP{tp} r{rollout} j{judge}"


def divisors(tp: int) -> list[int]:
    return [g for g in (1, 2, 4, 8) if g <= tp and tp % g == 0]


def _rate(r: dict[str, Any] | None) -> float:
    return r.get("samples_per_s", 0.0) if r else 0.0


ONE_ENGINE = {label((tp, tp, tp)) for tp in (1, 2, 4, 8)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: its best run of one engine an instance, its best layout, its elastic bound (best over sizes)."""
    out: dict[str, Any] = {}
    for mode, rs in runs.items():
        fixed = [r for r in rs if not r["elastic"]]
        one = max((r for r in fixed if r["layout"] in ONE_ENGINE), key=_rate, default=None)
        best = max(fixed, key=_rate, default=None)
        elastic = max((r for r in rs if r["elastic"]), key=_rate, default=None)
        out[mode] = {"one_engine": _rate(one) if one else None, "one_engine_layout": one["layout"] if one else None,
                     "best": _rate(best), "best_layout": best["layout"] if best else None,
                     "elastic": _rate(elastic) if elastic else None,
                     "elastic_layout": elastic["layout"] if elastic else None}  # fmt: skip
    best = {m: out[m]["best"] for m in out}
    elastic = {m: max(out[m]["elastic"] or 0.0, best[m]) for m in out}  # the better of the bound and a layout
    return {
        "modes": out,
        "speedup_vs_colocated": best["shiftable"] / best["colocated"],
        "speedup_vs_disaggregated": best["shiftable"] / best["disaggregated"],
        "elastic_speedup_vs_colocated": elastic["shiftable"] / elastic["colocated"],
        "elastic_speedup_vs_disaggregated": elastic["shiftable"] / elastic["disaggregated"],
    }


HEAD = ("group", "mode", "one engine", "best layout", "samples/s", "gain", "elastic", "gain")


def rows(g: dict[str, Any]) -> list[list[str]]:
    out = []
    for mode, m in g["modes"].items():
        one = m["one_engine"]

        def gain(x: float | None, one: float | None = one) -> str:
            return f"{x / one - 1:+.1%}" if x and one else "-"

        elastic = f"{m['elastic']:.1f}" if m["elastic"] else "-"
        out.append([g["name"], mode, f"{one:.1f}" if one else "-", m["best_layout"] or "-", f"{m['best']:.1f}",
                    gain(m["best"]), elastic, gain(m["elastic"])])  # fmt: skip
    return out
