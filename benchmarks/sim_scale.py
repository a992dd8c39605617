"""How long the simulator takes to run a cluster-scale job, per mode, and where the time goes.

Each run is ``pivotrl simulate examples/sim128.yaml sim.gpus=G mode=M steps=S``
in its own process, stopped after ``--timeout`` seconds (the steps it finished
by then are read from its metrics.jsonl). Disaggregated runs use a fixed split
scaled with the cluster (rollout 7/16, judge 3/16, train 6/16 of the devices:
the best of a few tried at 128 GPUs). The table gives virtual seconds per step,
wall seconds, events handled, and the wall time split between the simulator
driver and the control plane (summary.json's ``wall_split``).

``--profile MODE:GPUS`` instead runs one such job in this process under
cProfile for ``--steps`` steps (or until ``--timeout``) and reports the calls
with the most own time, with their call counts: what dominates when the
control plane is the bottleneck.

    .venv/bin/python benchmarks/sim_scale.py                        # 128 and 1024 GPUs, 3 modes, 20 steps
    .venv/bin/python benchmarks/sim_scale.py --gpus 128 --steps 3   # quick look
    .venv/bin/python benchmarks/sim_scale.py --profile shiftable:1024 --steps 1 --timeout 300
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from common import machine, write_report

from pivotrl.sim.versus import run_apart

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/sim128.yaml"
MODES = ("colocated", "disaggregated", "shiftable")


def overrides(mode: str, gpus: int, steps: int, tp: int = 1) -> list[str]:
    out = [f"sim.gpus={gpus}", f"mode={mode}", f"steps={steps}"]
    if mode == "disaggregated":
        devices = gpus // tp
        r, g = devices * 7 // 16, devices * 3 // 16
        out.append(f"split=rollout:{r},judge:{g},train:{devices - r - g}")
    return out


def run_one(mode: str, gpus: int, steps: int, timeout: float) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"sim-{mode}-{gpus}-"))
    # an error is a control-plane one (e.g. a livelock the driver stopped) or the timeout
    wall, error = run_apart(EXAMPLE, overrides(mode, gpus, steps), out, timeout)
    finished = error is None
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if out.exists() else []
    row: dict[str, Any] = {"mode": mode, "gpus": gpus, "steps": steps, "steps_done": len(metrics), "wall_s": wall}
    row["finished"] = finished
    if error:
        row["error"] = error
    if metrics:
        row["sim_s_per_step"] = sum(m["step_seconds"] for m in metrics) / len(metrics)
    if finished:
        s = json.loads((out / "summary.json").read_text())
        row.update(sim_s=s["sim_seconds"], events=s["sim"]["events"], wall_split=s["wall_split"],
                   samples_per_s=s["samples_per_s"], shifts=s["shifts"], migrations=s["migrations"])  # fmt: skip
    return row


def profile(mode: str, gpus: int, steps: int, limit: float, top: int = 30) -> dict[str, Any]:
    from pivotrl.config import load_config
    from pivotrl.sim.run import run_simulation

    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError

    cfg = load_config(EXAMPLE, overrides(mode, gpus, steps), simulated=True)
    prof = cProfile.Profile()
    summary = None
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(max(1, int(limit)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        prof.enable()
        try:
            summary = run_simulation(cfg, out)
        except TimeoutError:
            pass
        finally:
            prof.disable()
            signal.alarm(0)
        done = sum(1 for _ in (Path(out) / "metrics.jsonl").open())
    wall = time.perf_counter() - started
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # by own time
    calls = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_s": tt, "cumulative_s": ct}
             for (f, line, name), (_, nc, tt, ct, _) in rows]  # fmt: skip
    print(
        f"{mode} on {gpus} GPUs: {done}/{steps} step(s) in {wall:.1f} s under the profiler"
        + (f", {summary['sim']['events']} events, split {summary['wall_split']}" if summary else " (stopped)")
    )
    print(f"{'own s':>8} {'cum s':>8} {'calls':>11}  function")
    for c in calls:
        print(f"{c['own_s']:8.2f} {c['cumulative_s']:8.2f} {c['calls']:11d}  {c['function']}")
    return {"mode": mode, "gpus": gpus, "steps": steps, "steps_done": done, "wall_s": wall, "summary": summary,
            "top_calls": calls}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds of wall time a run may take")
    p.add_argument("--profile", help="MODE:GPUS to profile in this process instead of timing every run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sim_scale.json")
    args = p.parse_args()
    load = list(os.getloadavg())
    if args.profile:
        mode, gpus = args.profile.split(":")
        result = profile(mode, int(gpus), args.steps, args.timeout)
        write_report(args.out.with_name(f"sim_profile_{mode}_{gpus}.json"), {"machine": machine(load), **result})
        return
    rows = []
    print(f"{'gpus':>5} {'mode':>14} {'steps':>7} {'sim s/step':>10} {'wall s':>8} {'events':>8} {'driver s':>9} "
          f"{'control s':>9}")  # fmt: skip
    for gpus in args.gpus:
        for mode in args.modes:
            r = run_one(mode, gpus, args.steps, args.timeout)
            rows.append(r)
            split = r.get("wall_split", {})
            print(f"{gpus:>5} {mode:>14} {r['steps_done']:>3}/{r['steps']:<3} {r.get('sim_s_per_step', 0):>10.1f} "
                  f"{r['wall_s']:>8.1f}{'' if r['finished'] else '+'} {r.get('events', 0):>8} "
                  f"{split.get('driver', 0):>9.1f} {split.get('control_plane', 0):>9.1f}", flush=True)  # fmt: skip
            if "error" in r:
                print(f"      {r['error']}", flush=True)
    write_report(args.out, {"machine": machine(load), "config": str(EXAMPLE), "runs": rows})


if __name__ == "__main__":
    main()
