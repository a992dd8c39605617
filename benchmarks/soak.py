"""Soak: a small job for many steps, its memory watched, and what it leaves behind.

Runs ``pivotrl train`` on tiny random checkpoints (built here, nothing
downloaded) for ``--steps`` steps on ``--devices`` Ray devices in shiftable
mode, checkpoints on, and samples every ``--every`` seconds the resident
memory of the driver and every process under it (the Ray devices included)
and the bytes used in ``/dev/shm``. Reported: the slope of each against the
step (a least-squares line over the steps after the first 10%, per 100 steps,
and relative to the mean), and, after the command exits, the ``/dev/shm``
entries and the processes it started that are still there.

    .venv/bin/python benchmarks/soak.py                 # 500 steps, writes benchmarks/results/soak.json
    .venv/bin/python benchmarks/soak.py --quick         # 30 steps, a smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import ROOT, machine, write_report

from pivotrl.gpucheck.shapes import tiny_checkpoints

RESULTS = ROOT / "benchmarks" / "results" / "soak.json"
PAGE = os.sysconf("SC_PAGE_SIZE")


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process visible in /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(entry)] = (ppid, cmd)
    return out


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every process under it."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except OSError:
            pass
        todo += children.get(pid, [])
    return total


def shm_used() -> int:
    return shutil.disk_usage("/dev/shm").used


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value against step."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--quick", action="store_true", help="30 steps, a smoke run")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results/soak.json)")
    args = ap.parse_args()
    if args.quick:
        args.steps = 30
    if args.steps < 10 or args.devices < 2:
        ap.error("--steps must be >= 10 and --devices >= 2 (Ray devices)")
    out_json = args.out or (Path(tempfile.gettempdir()) / "pivotrl-soak-quick.json" if args.quick else RESULTS)
    load_at_start = list(os.getloadavg())

    with tempfile.TemporaryDirectory() as tmp:
        ckpts = tiny_checkpoints(Path(tmp))
        run = Path(tmp) / "run"
        shm_before, procs_before = set(os.listdir("/dev/shm")), processes()
        cmd = [
            sys.executable, "-m", "pivotrl.cli", "train", str(ROOT / "examples" / "default.yaml"),
            f"policy.path={ckpts['policy']}", f"judge.path={ckpts['judge']}", f"steps={args.steps}",
            f"devices={args.devices}", "mode=shiftable", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=16", "judge.max_new_tokens=16", "eval.every=0", "eval.size=16",
            "eval.max_new_tokens=16", "rollout.max_batch=16", "checkpoint.every=50", "--out", str(run), "--quiet",
        ]  # fmt: skip
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: list[dict[str, Any]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(args.every):
                samples.append(
                    {
                        "t": round(time.time() - t0, 1),
                        "step": steps_done(run),
                        "rss": tree_rss(proc.pid),
                        "shm": shm_used(),
                        "shm_entries": sorted(os.listdir("/dev/shm"))[:20],
                    }  # fmt: skip
                )

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, err = proc.communicate()
        stop.set()
        watcher.join()
        seconds = time.time() - t0
        time.sleep(5)  # whatever it leaves has had time to go
        left_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
        # new since the start and Ray's or ours by name: what the job left (Ray's agents outlive their raylet)
        marks = ("ray::", "raylet", "gcs_server", "pivotrl", "site-packages/ray/")
        left_procs = sorted(
            cmd for pid, (_, cmd) in processes().items()
            if pid not in procs_before and pid != os.getpid() and any(m in cmd for m in marks)
        )  # fmt: skip
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        raise SystemExit(f"the job failed (exit {proc.returncode})")
    warm = args.steps // 10
    steady = [s for s in samples if warm < s["step"] < args.steps]  # not the start, not the way out
    report: dict[str, Any] = {"benchmark": "soak", "steps": args.steps, "devices": args.devices, "seconds": seconds}
    for key in ("rss", "shm"):
        points = [(s["step"], s[key] / 2**20) for s in steady]
        mean = statistics.fmean(p[1] for p in points) if points else 0.0
        per100 = slope(points) * 100 if len(points) > 2 else 0.0
        report[key] = {
            "mean_mb": round(mean, 1),
            "first_mb": round(points[0][1], 1) if points else None,
            "last_mb": round(points[-1][1], 1) if points else None,
            "slope_mb_per_100_steps": round(per100, 3),
            "slope_fraction_per_100_steps": round(per100 / mean, 5) if mean else None,
        }
    report |= {"left_in_dev_shm": left_shm, "processes_left": left_procs, "samples": samples,
               "machine": machine(load_at_start)}  # fmt: skip
    print(f"{args.steps} steps on {args.devices} Ray devices in {seconds:.0f} s, {len(samples)} samples")
    print(f"{'':6} {'mean MB':>9} {'first':>8} {'last':>8} {'MB/100 steps':>13} {'of mean':>8}")
    for key in ("rss", "shm"):
        r = report[key]
        frac = r["slope_fraction_per_100_steps"]
        print(
            f"{key:6} {r['mean_mb']:>9} {r['first_mb']!s:>8} {r['last_mb']!s:>8} {r['slope_mb_per_100_steps']:>13}"
            f" {(f'{frac:.2%}' if frac is not None else '-'):>8}"
        )
    print(f"left in /dev/shm: {left_shm or 'nothing'}; processes left: {left_procs or 'none'}")
    write_report(out_json, report)


if __name__ == "__main__":
    main()
