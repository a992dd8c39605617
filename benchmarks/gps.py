"""Global Parameter Storage: publish latency, and fetch-into-model bandwidth against a plain memcpy.

Why these numbers: a role shift loads weights (or optimizer state) from the
GPS into a device that already holds a model of the right shape, so the cost
that matters is ``store.fetch(name, v).load_into(model)``. Fetching is
zero-copy (views of the stored buffer, or of the shared-memory Ray object), so
that cost should be one memcpy of the model's bytes: the ratio against a plain
``dst.copy_(src)`` of the same number of bytes (target >= 0.5) says how close
the GPS comes. Publish latency is what the trainer pays per step to make v+1
available: LocalStore packs once; RayStore packs and ``ray.put`` s the buffer
from the publishing process, handing the directory the ref, not the bytes (see
pivotrl/gps.py). The Ray publishes come from a Ray actor, as a device's do (its
process keeps the buffer it packs into); loads run in this process. Host copies per publish are counted by construction
(``PublishInfo.host_copies``: the passes of the CPU over the version's bytes
that the code path makes; the pack of tensors in host memory is one, a GPU's
bytes arriving by DMA in the page-locked staging buffer are none, Ray's put is
one) and cross-checked by time: ``publish / memcpy`` is the publish's time in
units of one plain memcpy of its bytes (a measurement; it also pays the
directory's round trip and, on a store not preallocated, page faults).
A trainer publishes its fp32 weights as the rollout's bf16: ``cast`` times that
publish (LocalStore) two ways, side by side: each tensor cast into a host copy
of the whole model first, then packed (how the trainers published before), and
each cast as ``pack`` copies it into the buffer (``gps.cast``: no copy first).

Models are random fp32 Llama-shaped decoders (8 layers, vocab 2048) sized to
the requested parameter counts. Every measurement is repeated, the sides
interleaved within a repeat, and the median reported. Everything runs on this
machine's CPUs; expect noise of tens of percent on a shared machine.

Threads: one torch thread by default (``--threads``), for memcpy and loads
alike, as in a Ray worker (Ray sets ``OMP_NUM_THREADS=1`` there). With as many
OpenMP threads as cores on a busy machine, once the process has touched Ray
objects every ``copy_`` slows down 5-100x: OpenMP threads spin-wait for a
descheduled peer (it goes away with ``OMP_WAIT_POLICY=PASSIVE``). That is a
property of the machine's oversubscription, not of the GPS.

Prefault: by default Ray maps object-store pages lazily, so a publish into a
region of the store not used before pays a page fault per 4 KiB: on this
machine a 100 MB publish took 35 ms or 450-970 ms depending on where it
landed. ``--prefault`` (on unless ``--no-prefault``) starts Ray with
``preallocate_plasma_memory``, which populates the whole store at startup, as
the runtime's own instance does (``pivotrl.gps_sizing``).

    .venv/bin/python benchmarks/gps.py                     # 1M, 25M, 100M; writes benchmarks/results/gps.json
    .venv/bin/python benchmarks/gps.py --sizes 1M,10M      # other sizes
    .venv/bin/python benchmarks/gps.py --quick             # smoke run (< 30 s), JSON to the temp dir
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray
import torch
from common import machine, parse_size, write_report

from pivotrl.gps import LocalStore, ParameterStore, PublishInfo, RayStore, cast, module_tensors
from pivotrl.model import Decoder, ModelConfig

RESULTS = Path(__file__).parent / "results" / "gps.json"
LAYERS, VOCAB, HEAD_DIM = 8, 2048, 32


def config_for(params: int) -> ModelConfig:
    """A decoder with about ``params`` parameters: 13 h^2 per layer (MHA, MLP 3h) plus 2 V h embeddings."""

    def make(h: int) -> ModelConfig:
        h = max(HEAD_DIM, h)
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=h,
            intermediate_size=3 * h,
            num_hidden_layers=LAYERS,
            num_attention_heads=h // HEAD_DIM,
            num_key_value_heads=h // HEAD_DIM,
            head_dim=HEAD_DIM,
        )

    a, b = 13 * LAYERS, 2 * VOCAB
    h = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    lo = int(h // HEAD_DIM) * HEAD_DIM
    return min((make(lo), make(lo + HEAD_DIM)), key=lambda c: abs(c.num_parameters() - params))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@ray.remote(num_cpus=0)
class Publisher:
    """The publishing side as on a device: a Ray actor (its process keeps its publish buffer, see
    ``gps_transfer.publish_staging``), holding the same model as the benchmark's source."""

    def __init__(self, cfg: ModelConfig, threads: int) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.tensors = module_tensors(Decoder(cfg))

    def publish(self, store: RayStore, name: str, version: int) -> PublishInfo:
        return store.publish(name, version, self.tensors)


def measure(size: int, reps: int, stores: dict[str, ParameterStore]) -> dict:
    cfg = config_for(size)
    torch.manual_seed(0)
    source = Decoder(cfg)
    target = copy.deepcopy(source)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()  # pages touched, values wrong until loaded
    tensors = module_tensors(source)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    name = f"bench-{size}"

    samples: dict[str, list[float]] = {"memcpy_s": [], "cast_host_copy_s": [], "cast_deferred_s": []}
    copies: dict[str, float] = {}
    local = LocalStore()
    publisher = Publisher.remote(cfg, torch.get_num_threads())
    for backend in stores:
        samples |= {f"{backend}_publish_s": [], f"{backend}_fetch_s": [], f"{backend}_load_s": []}
    for rep in range(reps + 1):  # rep 0 warms up (first-touch of buffers, lazy imports) and is dropped
        keep = rep > 0
        t = timed(lambda: dst.copy_(src))
        if keep:
            samples["memcpy_s"].append(t)
        for way, bf16 in (
            ("host_copy", lambda: {n: t.to(torch.bfloat16).cpu() for n, t in tensors.items()}),
            ("deferred", lambda: {n: cast(t, torch.bfloat16) for n, t in tensors.items()}),
        ):
            start = time.perf_counter()
            local.publish(f"{name}-cast-{way}", rep, bf16())
            if keep:
                samples[f"cast_{way}_s"].append(time.perf_counter() - start)
            local.free(f"{name}-cast-{way}", rep)
        for backend, store in stores.items():
            if isinstance(store, RayStore):  # published by a device, loaded here
                info = ray.get(publisher.publish.remote(store, name, rep))
            else:
                info = store.publish(name, rep, tensors)
            store.retain(name, keep_last=1)  # this version alone: the next publish lands beside it
            start = time.perf_counter()
            snap = store.fetch(name, rep)
            fetched = time.perf_counter()
            snap.load_into(target)
            done = time.perf_counter()
            copies[backend] = info.host_copies
            if keep:
                samples[f"{backend}_publish_s"].append(info.seconds)
                samples[f"{backend}_fetch_s"].append(fetched - start)
                samples[f"{backend}_load_s"].append(done - start)
            del snap
    for (n, a), (_, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        if not torch.equal(a, b):
            raise RuntimeError(f"fetched weights differ from the source at {n}")
    for store in stores.values():
        store.free(name, reps)
    ray.kill(publisher)

    med = {k: statistics.median(v) for k, v in samples.items()}
    out: dict = {
        "target_params": size,
        "params": sum(p.numel() for p in source.parameters()),
        "tensors": len(tensors),
        "bytes": nbytes,
        "config": {"hidden_size": cfg.hidden_size, "layers": LAYERS, "vocab_size": VOCAB},
        "samples": samples,
        "median": med,
        "memcpy_gb_s": nbytes / med["memcpy_s"] / 1e9,
    }
    for backend in stores:
        load_gb_s = nbytes / med[f"{backend}_load_s"] / 1e9
        out[f"{backend}_load_gb_s"] = load_gb_s
        out[f"{backend}_ratio"] = load_gb_s / out["memcpy_gb_s"]
        out[f"{backend}_host_copies"] = copies[backend]  # by construction (PublishInfo.host_copies)
        out[f"{backend}_publish_memcpys"] = med[f"{backend}_publish_s"] / med["memcpy_s"]  # measured
    return out


def print_table(results: list[dict], backends: list[str]) -> None:
    head = ["params", "MB", "memcpy GB/s", "bf16 publish ms: host copy first", "as copied"]
    for b in backends:
        head += [f"{b} publish ms", f"{b} host copies", "publish / memcpy", f"{b} fetch ms", f"{b} load GB/s"]
        head += [f"{b} ratio"]
    rows = []
    for r in results:
        m = r["median"]
        row = [f"{r['params'] / 1e6:.1f}M", f"{r['bytes'] / 1e6:.0f}", f"{r['memcpy_gb_s']:.2f}"]
        row += [f"{m['cast_host_copy_s'] * 1e3:.1f}", f"{m['cast_deferred_s'] * 1e3:.1f}"]
        for b in backends:
            row += [
                f"{m[f'{b}_publish_s'] * 1e3:.1f}",
                f"{r[f'{b}_host_copies']:g}",
                f"{r[f'{b}_publish_memcpys']:.1f}",
                f"{m[f'{b}_fetch_s'] * 1e3:.2f}",
                f"{r[f'{b}_load_gb_s']:.2f}",
                f"{r[f'{b}_ratio']:.2f}",
            ]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default=None, help="1M,25M,100M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every copy")
    ap.add_argument("--prefault", action=argparse.BooleanOptionalAction, default=True, help="populate Ray's store")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (< 30 s)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results/gps.json; temp dir if --quick)")
    args = ap.parse_args()
    if args.sizes is None:
        args.sizes = [10**6, 5 * 10**6] if args.quick else [10**6, 25 * 10**6, 100 * 10**6]
    if args.quick:
        args.repeats = min(args.repeats, 3)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "pivotrl-gps-quick.json" if args.quick else RESULTS
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(s < 1000 for s in args.sizes):
        ap.error(f"--sizes must be >= 1K parameters each, got {args.sizes}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    largest = 4 * max(config_for(s).num_parameters() for s in args.sizes)
    # the version published beside the one kept until retain(), with headroom
    store_memory = max(512 * 1024**2, 4 * largest)
    start = time.perf_counter()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=store_memory,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _system_config={"preallocate_plasma_memory": args.prefault},
    )
    ray_store = RayStore.create("gps-bench")
    ray.get(ray_store.directory.memory.remote())  # actor up before timing
    print(
        f"ray up in {time.perf_counter() - start:.1f} s, object store {store_memory / 2**30:.1f} GiB, "
        f"prefault {'on' if args.prefault else 'off'}"
    )
    stores: dict[str, ParameterStore] = {"local": LocalStore(), "ray": ray_store}
    load = os.getloadavg()
    try:
        results = []
        for size in args.sizes:
            results.append(measure(size, args.repeats, stores))
            r = results[-1]
            print(f"  {r['params'] / 1e6:.1f}M params: ratio local {r['local_ratio']:.2f}, ray {r['ray_ratio']:.2f}")
    finally:
        ray_store.shutdown()
        ray.shutdown()

    print(
        f"fp32 Llama-shaped decoders ({LAYERS} layers, vocab {VOCAB}), median of {args.repeats}, "
        f"torch threads {torch.get_num_threads()}, load average at start {load[0]:.2f}"
    )
    print("publish = pack + store; host copies = the CPU's passes over the bytes per publish, by construction;")
    print("publish / memcpy = publish time in plain memcpys; fetch = zero-copy views; load = fetch + load_into(model);")
    print("ratio = load / memcpy")
    print_table(results, list(stores))
    report = {
        "benchmark": "gps",
        "quick": args.quick,
        "repeats": args.repeats,
        "threads": args.threads,
        "ray_prefault": args.prefault,
        "versions": {"torch": torch.__version__, "ray": ray.__version__, "numpy": np.__version__},
        "machine": {**machine(load), "torch_threads": torch.get_num_threads()},
        "results": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
