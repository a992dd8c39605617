"""What an engine in a process of its own costs: its start, its memory, and a shift's wake and sleep across
processes against the same in one.

Why: on each GPU a device runs one process per model whose engine needs one
(vLLM: one sleep-mode allocator per process; see docs/backends.md, "The
process model"). Such a process is started with its device, in parallel with
the others, so its start and imports are paid once per run, not per shift; a
shift then costs what the engine's wake and load cost, plus the actor calls
that carry it. This script measures each part on this machine:

- ``start``: from asking Ray for the engine's actor to its first answer (a
  process, torch, and vLLM imported), and the resident memory (RSS) it then
  holds; beside it a device-like process that imports the runtime without
  vLLM, for what the engine's process adds.
- ``build``: the first ``open`` (the engine built, the version loaded from the
  GPS), and the RSS after it.
- ``sleep`` / ``wake``: ``release`` then ``open`` again with the next version
  (on a CPU vLLM has no sleep mode: the engine stays, the version is loaded).
- ``call``: the round trip of a waited call that does nothing (median).

The same ``build``/``sleep``/``wake`` run in this process through the same
client (the in-process host a CPU allows), as the reference.

    .venv/bin/python benchmarks/processes.py                   # 25M-parameter policy shape
    .venv/bin/python benchmarks/processes.py --size 100M

Writes benchmarks/results/processes.json. Models are random, Qwen2-shaped,
head_dim 32 (what vLLM's CPU attention takes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, machine, parse_size, write_report  # noqa: E402

RESULTS = ROOT / "benchmarks/results/processes.json"


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (Linux /proc), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


class Bare:
    """A process importing what a device process imports, without vLLM: the baseline of the RSS comparison."""

    def __init__(self) -> None:
        import pivotrl.runtime.worker  # noqa: F401

    def pid(self) -> int:
        return os.getpid()


def model(params: int) -> Any:
    from dataclasses import replace

    from pivotrl.gpucheck.shapes import Shape
    from pivotrl.model import Decoder, char_tokenizer

    tok = char_tokenizer()
    hidden = 128
    while 12 * hidden * hidden * 2 < params and hidden < 4096:  # ~12 h^2 per layer, 2 layers at least
        hidden += 128
    layers = max(2, params // (12 * hidden * hidden))
    shape = Shape(hidden=hidden, layers=layers, heads=hidden // 32, kv_heads=max(1, hidden // 128),
                  intermediate=3 * hidden, vocab=tok.vocab_size)  # fmt: skip
    cfg = replace(shape.model_config(), architecture="Qwen2ForCausalLM", qkv_bias=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=list(tok.eos_token_ids))  # fmt: skip
    return Decoder(cfg), tok


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cycle(client: Any, repeats: int) -> dict[str, float]:
    """build, then ``repeats`` sleep/wake cycles alternating versions 1 and 0, and waited no-op calls."""
    build, _ = timed(lambda: client.open(0))
    sleeps, wakes = [], []
    for i in range(repeats):
        sleeps.append(timed(client.release)[0])
        wakes.append(timed(lambda i=i: client.open(1 - i % 2))[0])
    calls = [timed(lambda: client.ensure_capacity(8))[0] for _ in range(50)]
    return {
        "build_s": round(build, 3),
        "sleep_s": round(statistics.median(sleeps), 4),
        "wake_s": round(statistics.median(wakes), 4),
        "call_ms": round(1000 * statistics.median(calls), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="25M", help="policy parameters (e.g. 25M, 100M)")
    ap.add_argument("--repeats", type=int, default=5, help="sleep/wake cycles")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    load = list(os.getloadavg())

    import ray

    from pivotrl.engine.vllm_engine import available
    from pivotrl.gps import RayStore
    from pivotrl.runtime.contexts import POLICY, ContextSpec, publish_checkpoint
    from pivotrl.runtime.engine_host import EngineHost, local_client, ray_client

    if not available():
        print("processes: vLLM is not installed here (make install adds it); nothing to measure")
        return 0
    policy, tok = model(parse_size(args.size))
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        store = RayStore.create("pivotrl-bench-processes")
        publish_checkpoint(store, POLICY, 0, policy, tok)
        publish_checkpoint(store, POLICY, 1, policy, tok)
        spec = ContextSpec(rollout_backend="vllm", judge_backend="vllm", max_batch=16, max_len=128)
        bare = ray.remote(Bare).options(num_cpus=0).remote()
        host = ray.remote(EngineHost).options(num_cpus=0)
        start, actor = timed(lambda: host.remote(POLICY, store, spec, 1))
        start_ray, pid = timed(lambda: ray.get(actor.pid.remote()))
        bare_pid = ray.get(bare.pid.remote())
        remote: dict[str, Any] = {
            "start_s": round(start + start_ray, 3),
            "rss_started_mb": rss_mb(pid),
            "device_like_rss_mb": rss_mb(bare_pid),
        }
        remote |= cycle(ray_client(actor, POLICY), args.repeats)
        remote["rss_built_mb"] = rss_mb(pid)
        here = cycle(local_client(EngineHost(POLICY, store, spec, 1)), args.repeats)
    finally:
        ray.shutdown()
    report = {
        "machine": machine(load),
        "policy_parameters": policy.config.num_parameters(),
        "own_process": remote,
        "in_process": here,
    }
    print(f"engine of {policy.config.num_parameters() / 1e6:.1f}M parameters (vLLM, CPU), own process vs in process")
    print(f"{'':<22}{'own process':>14}{'in process':>14}")
    for key in ("build_s", "sleep_s", "wake_s", "call_ms"):
        print(f"{key:<22}{remote[key]:>14}{here[key]:>14}")
    print(
        f"start (process, imports) {remote['start_s']} s; RSS started {remote['rss_started_mb']} MB, built "
        f"{remote['rss_built_mb']} MB; a device-like process without vLLM {remote['device_like_rss_mb']} MB"
    )
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
