"""What follows from a model group's runs and its ideal, and the tables that say it.

A group (``pivotrl.sim.groupbench.bench``) holds its runs per mode and its ideal step at each instance size;
``derive`` adds each mode's share of the ideal and of the floor, shiftable's speedups, and the most any
on-policy schedule could gain over each baseline. The rest reads a group, or a report of several, as the rows
and notes ``benchmarks/paper.py`` prints and writes. Older reports lack some fields; each reader says which
it can do without.
"""

from __future__ import annotations

from typing import Any

from pivotrl.sim.steady import ROLES
from pivotrl.sim.versus import LABELS, MODES


def floor_rate(i: dict[str, Any]) -> float:
    """``IdealStep.floor_samples_per_s`` of a report's ideal (older reports do not have it)."""
    return i["samples_per_s"] * i["step_seconds"] / i["floor_seconds"]


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


def rate_text(r: dict[str, Any]) -> str:
    return f"{r['samples_per_s']:.1f} samples/s, {r['step_seconds']:.1f} s/step" if "samples_per_s" in r else r["error"]


HEAD = ("group", "mode", "layout", "samples/s", "step s", "rollout s", "of ideal", "of floor", "rollout", "judge",
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
    out.append([label or g["name"], "ideal", f"TP{g['instance_gpus']}, batch {i['rollout_batch']}/{i['judge_batch']}",
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
        busy = r["busy_fraction"]["judge"] * r["step_seconds"]
        work = (i["gpu_seconds"]["judge_prefill"] + i["gpu_seconds"]["judge_decode"]) / g["gpus"]
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


def sweep_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    return [r for g in points for r in rows(g, f"{g['sweep']}: {g['point']}")]


def report_text(report: dict[str, Any]) -> tuple[list[list[str]], list[str], str, str]:
    """The table rows, the notes, the title and the label of a report."""
    if "points" in report:
        items = report["points"]
        notes = [f"{g['sweep']} {g['point']}: {speedups(g)}" for g in items] + unbuilt_notes(items, "point")
        gpus = report["settings"]["gpus"]
        title = f"dense-7b sensitivity (base {gpus} GPUs): tail, judge size, judgment length, cluster size"
        return sweep_rows(items), notes, title, "point"
    items = report["groups"]
    notes = [f"{g['name']} ({g['policy']} + {g['judge']} judge): {speedups(g)}" for g in items]
    notes += [f"{g['name']}: {line}" for g in items if (line := gap(g))]
    notes += unbuilt_notes(items, "name")
    title = f"{report['settings']['gpus']} x H100: steady samples/s by mode and the ideal"
    return [r for g in items for r in rows(g)], notes, title, "name"


def unbuilt_notes(items: list[dict[str, Any]], label: str) -> list[str]:
    """Per group (or point), the instance sizes not run as no layout the runtime builds, and why (``unbuilt``)."""
    return [f"{g[label]}: TP{tp} not run, no layout the runtime builds ({why})"
            for g in items for tp, why in g.get("unbuilt", {}).items()]  # fmt: skip


class Unbuilt(ValueError):
    """A mode's run is at an instance size the runtime builds no layout at: it must run again."""


def drop_unbuilt(g: dict[str, Any], unbuilt: dict[str, str]) -> dict[str, Any]:
    """``g`` without its runs at the sizes of ``unbuilt`` (size -> why the runtime builds no such layout), which
    it records; a mode whose chosen run is at one of them cannot be kept (``Unbuilt``)."""
    for mode, r in g["modes"].items():
        if str(r.get("instance_gpus")) in unbuilt:
            raise Unbuilt(f"{g.get('name', g.get('point'))} {mode} ran at TP{r['instance_gpus']}, no layout the "
                             f"runtime builds ({unbuilt[str(r['instance_gpus'])]}): run it again")  # fmt: skip
        for key in ("sizes", "search"):
            if key in r:
                r[key] = [t for t in r[key] if str(t["tp"]) not in unbuilt]
    g["ideals"] = {tp: i for tp, i in g.get("ideals", {}).items() if tp not in unbuilt}
    if unbuilt:
        g["unbuilt"] = {**g.get("unbuilt", {}), **unbuilt}
    return g


def update_note(report: dict[str, Any]) -> str:
    """The wall-time note of a report whose modes were run again (``--update``): which, at which code."""
    return (
        f"wall time {report.get('wall_s', 0.0) / 60:.1f} min (runs at {report.get('code', '?')}; "
        + "; ".join(f"{', '.join(u['modes'])} again at {u['code']}" for u in report["updates"])
        + ")"
    )


def rerender_note(report: dict[str, Any]) -> str:
    """The wall-time note of a report drawn again (``--rerender``): its runs' code and the ideals' code."""
    again = "".join(f"{', '.join(u['modes'])} again at {u['code']}; " for u in report.get("updates", []))
    return (f"wall time {report.get('wall_s', 0.0) / 60:.1f} min (runs at {report.get('code', '?')}; {again}"
            f"ideals and bounds at {report['rerendered']['code']})")  # fmt: skip
