"""The headline tables of docs/benchmarks.md, rendered from the committed reports in benchmarks/results/.

The reference page shows each benchmark's current table; the numbers come from the JSON a benchmark wrote, never
typed by hand, so a re-run changes the page by running this script. Each table sits between two marker comments
(``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``); everything outside the markers is prose and left alone.

    python benchmarks/tables.py           # rewrite the tables in docs/benchmarks.md
    python benchmarks/tables.py --check   # exit 1 if a table differs from what the JSON gives
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"

Report = dict[str, Any]
GROUP_SAMPLES = 8192  # samples a step in examples/sim128.yaml, the 128-GPU groups' job


def md(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A markdown table: the first ``left`` columns left-aligned, the others (numbers) right-aligned."""
    rule = ["---" if i < left else "---:" for i in range(len(head))]
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, rule, *rows])


def load(name: str, results: Path) -> Report:
    return json.loads((results / f"{name}.json").read_text())


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


# -- CPU, measured ---------------------------------------------------------------------------------------------


def engine(results: Path) -> str:
    r = load("engine", results)
    names = {"random": "3.2M random", "25m": "25M random", "bundled": "bundled 0.4M"}
    shown = {"mixed x256": "256 mixed", "one batch, no stop": "one batch, to the cap"}
    rows = []
    for w in r["workloads"]:
        if w["workload"] not in shown:
            continue
        e = w["engines"]
        base = e["transformers"]["median"]["tokens_per_s"]

        def cell(name: str, e: dict[str, Any] = e, base: float = base) -> str:
            tps = e[name]["median"]["tokens_per_s"]
            return f"{tps:.0f} ({tps / base:.2f}x)"

        rows.append(
            [names.get(w["model"], w["model"]), shown[w["workload"]], cell("pivotrl"), cell("vllm"), f"{base:.0f}"]
        )
    return md(["model", "workload", "native tok/s", "vLLM tok/s", "transformers tok/s"], rows, left=2)


def engine_sampling(results: Path) -> str:
    r = load("engine_sampling", results)
    rows = []
    for batch, row in r["batches"].items():
        ms = {name: row[name]["ms"] for name in ("processor", "element-wise processor", "vllm", "vllm seeded")}
        rows.append([batch, f"{ms['processor']:.1f}", f"{ms['element-wise processor']:.1f}", f"{ms['vllm']:.1f}",
                     f"{ms['vllm seeded']:.1f}", f"{row['processor_over_vllm']:.2f}x"])  # fmt: skip
    head = ["batch", "processor", "element-wise processor", "vLLM sampler", "vLLM, seeded rows", "processor / vLLM"]
    return md(head, rows)


def gps(results: Path) -> str:
    r = load("gps", results)
    rows = []
    for x in r["results"]:
        m = x["median"]
        rows.append([
            f"{x['params'] / 1e6:.1f}M", f"{x['memcpy_gb_s']:.2f}",
            f"{x['local_load_gb_s']:.2f} ({x['local_ratio']:.2f}x)",
            f"{x['ray_load_gb_s']:.2f} ({x['ray_ratio']:.2f}x)",
            f"{1e3 * m['ray_publish_s']:.1f} ({x['ray_publish_memcpys']:.1f})", f"{x['ray_host_copies']:g}",
            f"{1e3 * m['cast_deferred_s']:.1f} ({1e3 * m['cast_host_copy_s']:.1f})",
        ])  # fmt: skip
    head = [
        "parameters",
        "memcpy GB/s",
        "load GB/s in-process (of memcpy)",
        "through Ray",
        "Ray publish ms (memcpys)",
        "host copies a publish",
        "bf16 publish ms (host copy)",
    ]
    return md(head, rows)


def train_memory(results: Path) -> str:
    r = load("train_memory", results)
    mb = 1e6
    rows = []
    for f, z in zip(r["runs"], r["zero"]["runs"], strict=True):
        rows.append([
            str(f["world_size"]),
            f"{f['peak_bytes_per_device'] / mb:.0f}", f"{f['predicted_bytes_per_device'] / mb:.0f}",
            f"{z['peak_bytes_per_device'] / mb:.0f}", f"{z['predicted_bytes_per_device'] / mb:.0f}",
        ])  # fmt: skip
    head = ["train devices", "FSDP2 peak MB", "FSDP2 predicted", "ZeRO-1 peak MB", "ZeRO-1 predicted"]
    out = md(head, rows)
    a = r["qwen2_5_7b_arithmetic"]
    names = {"fsdp": "FSDP2", "zero": "ZeRO-1", "replicated": "replicated"}
    arith = [[names[k], f"{a[k]['total_per_device'] / 1e9:.1f}", str(a[k]["fewest_devices"] or "none")] for k in names]
    head = [f"Qwen2.5-7B on {a['world_size']} devices", "GB per device", "fewest 80 GB devices"]
    return out + "\n\n" + md(head, arith)


def moe(results: Path) -> str:
    r = load("moe", results)
    loop = r["variants"]["loop"]["median_s"]
    rows = [[name, f"{v['median_s']:.2f}", f"{v['gflops_per_s']:.0f}", _x(loop / v["median_s"])]
            for name, v in r["variants"].items()]  # fmt: skip
    head = f"{r['device_name']}, {r['dtype']}, {r['tokens']} tokens:\n\n"
    return head + md(["variant", "seconds", "GFLOP/s", "vs loop"], rows)


def shift(results: Path) -> str:
    r = load("shift", results)
    pairs = ["none->rollout", "rollout->judge", "judge->train", "train->rollout"]

    def label(p: str) -> str:
        a, b = (x.replace("judge", "judge") for x in p.split("->"))
        return f"{a} to {b} ms"

    rows = []
    for x in r["results"]:
        rows.append([x["backend"], f"{x['params'] / 1e6:.1f}M", f"{x['load_gb_s']:.2f}",
                     *(f"{1e3 * x['pairs'][p]['median_s']:.1f}" for p in pairs)])  # fmt: skip
    return md(["GPS", "parameters", "load GB/s", *map(label, pairs)], rows, left=2)


def processes(results: Path) -> str:
    r = load("processes", results)
    own, here = r["own_process"], r["in_process"]
    rows = [[k, str(own[k]), str(here[k])] for k in ("build_s", "sleep_s", "wake_s", "call_ms")]
    rows += [["start_s (process, imports)", str(own["start_s"]), "-"],
             ["RSS MB: started / built / a device without vLLM",
              f"{own['rss_started_mb']} / {own['rss_built_mb']} / {own['device_like_rss_mb']}", "-"]]  # fmt: skip
    return md([f"{r['policy_parameters'] / 1e6:.1f}M, vLLM", "own process", "in process"], rows)


def soak(results: Path) -> str:
    r = load("soak", results)
    rss, shm = r["rss"], r["shm"]
    rows = [[
        str(r["steps"]), str(r["devices"]), f"{r['seconds']:.0f}",
        f"{rss['first_mb']:.0f} / {rss['last_mb']:.0f} ({100 * rss['slope_fraction_per_100_steps']:.2f}%)",
        f"{shm['first_mb']:.0f} / {shm['last_mb']:.0f} ({100 * shm['slope_fraction_per_100_steps']:.1f}%)",
        str(len(r["left_in_dev_shm"])), str(len(r["processes_left"])),
    ]]  # fmt: skip
    head = ["steps", "devices", "seconds", "resident MB first / last (slope a 100 steps)", "/dev/shm MB (slope)",
            "left in /dev/shm", "processes left"]  # fmt: skip
    return md(head, rows, left=0)


def modes(results: Path) -> str:
    r = load("modes", results)
    best = r["best"]["disaggregated"]["split"]
    rows = []
    for x in r["rows"]:
        name = x["mode"] + (f" `{x['split']}`" + (" (best)" if x["split"] == best else "") if x["split"] else "")
        rows.append([name, f"{x['steady_samples_per_s']:.1f}", str(x["shifts"]), str(x["migrations"]),
                     f"{x['accuracy_end']:.3f}"])  # fmt: skip
    out = md(["mode", "steady samples/s", "shifts", "migrations", "accuracy at the end"], rows)
    q = r["ratios"]
    return out + (f"\n\nshiftable / colocated {_x(q['shiftable_vs_colocated'])}, shiftable / best split "
                  f"{_x(q['shiftable_vs_disaggregated'])} ({r['devices']} devices, {r['steps']} steps).")  # fmt: skip


def semantics(results: Path) -> str:
    r = load("semantics", results)
    rows = []
    for x in r["runs"].values():
        rows.append([x["mode"], str(x["devices"]), str(x["steps"]), f"{x['samples_per_s']:.1f}", str(x["shifts"]),
                     str(x["migrations"]), f"{x['accuracy_start']:.2f} to {x['accuracy_end']:.3f}",
                     f"{x['judge_agreement']:.3f}"])  # fmt: skip
    head = ["mode", "devices", "steps", "samples/s", "shifts", "migrations", "held-out accuracy", "judge agreement"]
    c = r["comparison"]
    return md(head, rows) + (
        f"\n\nSame tokens: {c['same_tokens']:,} of {c['samples']:,} sequences; same reward: {c['same_reward']:,}; "
        f"largest accuracy gap at an evaluation: {c['max_accuracy_gap']:.3f}."
    )


def tensor_parallel(results: Path) -> str:
    r = load("tensor_parallel", results)
    rows = []
    for x in r["runs"].values():
        audit = x.get("migration_audit") or {}
        rows.append([str(x["tensor_parallel"]), str(x["steps"]), f"{x['steady_samples_per_s']:.1f}", str(x["shifts"]),
                     str(x["migrations"]), f"{x['accuracy_start']:.2f} to {x['accuracy_end']:.3f}",
                     f"{audit.get('identical', 0)} of {audit.get('checked', 0)}"])  # fmt: skip
    head = ["tensor_parallel", "steps", "samples/s", "shifts", "migrations", "held-out accuracy",
            "audited migrations identical"]  # fmt: skip
    c = r["comparison"]
    return md(head, rows) + (
        f"\n\nSame tokens: {c['same_tokens']:,} of {c['samples']:,} sequences; same reward: {c['same_reward']:,}; "
        f"held-out gain differs by {r['gain_difference']:.3f}."
    )


def staleness(results: Path) -> str:
    r = load("staleness", results)
    rows = []
    for name, v in r["variants"].items():
        by_seed = ", ".join(f"{a:.3f}" for a in v["accuracy_end_by_seed"].values())
        lags = ", ".join(f"{lag}: {n:,}" for lag, n in v["lags"].items())
        weight = v.get("is_weight_mean")
        rows.append([name, " ".join(x for x in v["overrides"] if x != "max_staleness=0") or "on-policy",
                     f"{v['accuracy_end_mean']:.3f} ({by_seed})", f"{v.get('accuracy_end_vs_on_policy', 0.0):+.3f}",
                     f"{v['samples_per_s_mean']:.1f}", f"{v['steady_samples_per_s_mean']:.1f}", lags,
                     f"{weight:.4f}" if weight else ""])  # fmt: skip
    head = ["variant", "settings", "held-out accuracy at the end (seeds)", "vs on-policy", "samples/s",
            "after step 1", "samples by versions behind", "mean importance weight"]  # fmt: skip
    return md(head, rows) + f"\n\nSeeds {', '.join(map(str, r['seeds']))}; means over them."


def sim_scale(results: Path) -> str:
    r = load("sim_scale", results)
    rows = [[x["mode"], str(x["gpus"]), str(x["steps_done"]), f"{x['wall_s']:.1f}", f"{x['events']:,}",
             f"{x['sim_s_per_step']:.1f}", f"{x['samples_per_s']:.1f}"] for x in r["runs"]]  # fmt: skip
    head = ["mode", "GPUs", "steps", "wall s", "events", "simulated s a step", "simulated samples/s"]
    return md(head, rows)


def fidelity(results: Path) -> str:
    r = load("fidelity", results)
    rows = []
    for x in r["rows"]:
        seeds = x["predicted"].get("step_by_seed") or [x["predicted"]["step"]]
        rows.append([x["case"] + (f" `{x['split']}`" if x["split"] else ""), f"{x['measured']['step']:.2f}",
                     f"{x['predicted']['step']:.2f}", f"{min(seeds):.2f}-{max(seeds):.2f}",
                     f"{x['error_pct']:+.1f}%"])  # fmt: skip
    return md(["case", "measured s a step", "predicted (mean)", "each seed", "error"], rows)


def estimate(results: Path) -> str:
    r = load("estimate", results)
    by: dict[tuple[str, int], dict[float, dict[str, Any]]] = {}
    for x in r["rows"]:
        by.setdefault((x["group"], x["instance_gpus"]), {})[x["at"]] = x
    at = r["at"]
    rows = []
    for (group, tp), points in by.items():
        rows.append([group, f"TP{tp}", *(f"{points[a]['step_end_error_s']:+.1f} ({points[a]['step_end_abs_s']:.1f})"
                                         for a in at)])  # fmt: skip
    head = ["group", "instance", *(f"at {_pct(a)} of the rollout, s (abs)" for a in at)]
    return md(head, rows, left=2)


# -- simulated, 128 H100s --------------------------------------------------------------------------------------


def _ideals(g: Report) -> dict[str, Report]:
    return g.get("ideals") or {str(g["instance_gpus"]): g["ideal"]}


def _floor_rate(i: Report) -> float:
    """Samples/s if a step took its floor."""
    return i["samples_per_s"] * i["step_seconds"] / i["floor_seconds"]


def paper(results: Path) -> str:
    r = load("paper", results)
    rows = []
    for g in r["groups"]:
        m = g["modes"]

        def cell(mode: str, g: Report = g, m: Report = m) -> str:
            x = m[mode]
            split = ""
            if x.get("split"):
                split = " `" + "/".join(p.split(":")[1] for p in x["split"].split(",")) + "`"
            tp = x.get("instance_gpus", g["instance_gpus"])
            return f"{x['samples_per_s']:.1f} ({_pct(g['floor_fraction'][mode])}) TP{tp}{split}"

        bound = max(_floor_rate(i) for i in _ideals(g).values())
        rows.append([
            g["name"], *(cell(k) for k in ("deployed", "colocated", "disaggregated",
                                                                              "shiftable")),
            f"{g['ideal']['samples_per_s']:.1f}", f"{bound:.1f}",
            " / ".join(_x(g[f"speedup_vs_{b}"]) for b in ("deployed_colocated", "colocated", "disaggregated")),
            " / ".join(_x(g[f"bound_vs_{b}"]) for b in ("deployed_colocated", "colocated", "disaggregated")),
        ])  # fmt: skip
    head = ["group", "colocated, deployed", "colocated, strong", "best static split", "shiftable", "ideal",
            "floor bound", "shiftable vs deployed / strong / split", "no schedule beyond"]  # fmt: skip
    return md(head, rows)


def gap(results: Path) -> str:
    r, fsdp = load("gap", results), load("gap_fsdp", results)
    lockstep = {g["name"]: g["variants"]["modeled"]["mean_step_seconds"] for g in fsdp["groups"]}
    order = ["modeled", "free shifts", "free migrations", "both free"]
    rows = []
    for g in r["groups"]:
        v = g["variants"]
        trainer = next(iter(v["modeled"]["runs"].values()))["train_backend"]
        other = f"{lockstep[g['name']]:.1f}" if trainer == "zero" and g["name"] in lockstep else "-"
        rows.append([g["name"], {"zero": "ZeRO-1", "fsdp": "FSDP2"}.get(trainer, trainer), f"{g['floor_seconds']:.1f}",
                     *(f"{v[k]['mean_step_seconds']:.1f} ({_pct(v[k]['floor_fraction'])})" for k in order),
                     other])  # fmt: skip
    head = ["group", "trainer", "floor s", "as modeled s (of floor)", "free shifts", "free migrations", "both free",
            "FSDP2 as modeled"]  # fmt: skip
    return md(head, rows, left=2)


def reach(results: Path) -> str:
    r = load("reach", results)
    rows = []
    for g in r["groups"]:
        best = g["best_seconds"]
        name = g["name"] + (" (FSDP2)" if g["lockstep"] else "")
        rows.append([name, f"{g['floor_seconds']:.1f}", f"{g['floors_judge']['seconds']:.1f}",
                     f"{best:.1f} ({g['best_target']})", _pct(g["floor_seconds"] / best),
                     f"{g['shiftable_seconds']:.1f}", _pct(best / g["shiftable_seconds"])])  # fmt: skip
    head = ["group", "floor s", "floor's judge s", "batched judge s (batch)", "floor / batched", "shiftable s",
            "shiftable / batched"]  # fmt: skip
    return md(head, rows)


def layouts(results: Path) -> str:
    r = load("layouts", results)
    rows = []
    for g in r["groups"]:
        cells = []
        for mode in ("colocated", "disaggregated", "shiftable"):
            runs = g["runs"][mode]
            fixed = [x for x in runs if not x["elastic"]]

            def one(x: Report) -> bool:
                tp, rr, jj = x["layout"].split()
                return rr[1:] == jj[1:] == tp[2:]

            best = max(x["samples_per_s"] for x in fixed if one(x))
            per_role = max(x["samples_per_s"] for x in fixed)
            elastic = max(x["samples_per_s"] for x in runs if x["elastic"])
            cells.append(f"{best:.1f} / {per_role:.1f} / {elastic:.1f}")
        rows.append([g["name"], *cells])
    head = ["group", "colocated: one engine / per role / elastic", "split", "shiftable"]
    return md(head, rows)


TABLES: dict[str, Callable[[Path], str]] = {
    "engine": engine,
    "engine_sampling": engine_sampling,
    "gps": gps,
    "train_memory": train_memory,
    "moe": moe,
    "shift": shift,
    "processes": processes,
    "soak": soak,
    "modes": modes,
    "semantics": semantics,
    "tensor_parallel": tensor_parallel,
    "staleness": staleness,
    "sim_scale": sim_scale,
    "fidelity": fidelity,
    "estimate": estimate,
    "paper": paper,
    "gap": gap,
    "reach": reach,
    "layouts": layouts,
}

MARKED = re.compile(r"(<!-- table:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def _filled(m: re.Match[str], results: Path) -> str:
    """One marked table as the reports give it. An unknown table name fails loudly."""
    name = m["name"]
    if name not in TABLES:
        raise KeyError(f"docs table {name!r}: no such table (known: {', '.join(TABLES)})")
    return f"{m[1]}{TABLES[name](results)}\n{m[4]}"


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked table replaced by what the reports give."""
    return MARKED.sub(lambda m: _filled(m, results), text)


def stale(text: str, results: Path = RESULTS) -> list[str]:
    """The names of the marked tables in ``text`` that differ from what the reports give."""
    return [m["name"] for m in MARKED.finditer(text) if m[0] != _filled(m, results)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a table in the doc is stale; write nothing")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    text = args.doc.read_text()
    if args.check:
        names = stale(text, args.results)
        if names:
            print(f"{args.doc}: stale tables: {', '.join(names)} (run: python benchmarks/tables.py)", file=sys.stderr)
            return 1
        return 0
    new = render(text, args.results)
    if new != text:
        args.doc.write_text(new)
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
