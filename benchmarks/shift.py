"""Role-shift latency: what a device pays to change role, per role pair and model size.

Why these pairs: while a step runs, a device moves between rollout, judge (the
judge) and train, and each move goes through ``Worker.shift(role, version)``:
release the current context, rebuild the next one from the GPS. The pairs are
the eight a step can produce, run as one cycle so every measurement starts
from the role it names::

    none -> rollout -> judge -> train -> rollout -> rollout(v1) -> train -> judge -> rollout

``rollout->rollout`` is the weight refresh of a new policy version (same model,
engine and KV cache kept, only the bytes reloaded); every other pair releases
one context and builds another: a model allocated and filled from the GPS,
plus an engine with its KV cache (rollout, judge) or a trainer whose AdamW
state is restored from the GPS (train; its bytes count weights + optimizer).

Where the time goes: besides the shifts, the same process times the parts
alone, each repeated: ``load`` = ``store.fetch(...).load_into(model)`` into a
model that already holds weights (the floor: one memcpy of the bytes),
``alloc`` = the meta -> ``to_empty`` allocation of a model, ``build`` =
``build_model`` as a context calls it (alloc + first load into fresh pages +
tokenizer), ``engine`` = ``Engine(...)`` (allocates and zeroes the KV cache),
``trainer`` = GRPO trainer + AdamW construction, ``opt restore`` =
``import_state(weights=False)`` (allocates and fills the AdamW state), and the
``release`` of each context. ``load %`` in the shift table is the share of a
shift that moving its bytes at the ``load`` rate would take; the rest is
allocation, page faults, zeroing and object construction.

Models: random-init Qwen2-style decoders (GQA, qkv bias, char tokenizer, vocab
99) sized to the requested parameter counts; policy and judge the same size.
Published to the store before timing: policy v0 and v1 with AdamW state for
both (two fake steps), and the judge. Each shift is timed by the worker
(``ShiftDone.seconds``) and by an outer wall clock around the call (for the
Ray actor that adds the round trip). The first cycle warms up and is dropped;
median and max of ``--repeats`` cycles are reported. Everything runs on this
machine's CPUs with one torch thread by default (``--threads``), as in a Ray
worker; on a shared machine expect noise of tens of percent.

    .venv/bin/python benchmarks/shift.py --ray       # 1M, 25M, 100M, local + Ray; writes benchmarks/results/shift.json
    .venv/bin/python benchmarks/shift.py --sizes 5M  # other sizes, LocalStore only
    .venv/bin/python benchmarks/shift.py --quick     # smoke run (< 30 s), JSON to the temp dir
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from common import machine, parse_size, write_report

from pivotrl.config import JobConfig
from pivotrl.control.messages import Role, ShiftDone
from pivotrl.engine import Engine
from pivotrl.gps import Kind, LocalStore, ParameterStore, RayStore, publish_optimizer
from pivotrl.model import Decoder, ModelConfig, char_tokenizer
from pivotrl.resolve import Hardware, resolve
from pivotrl.runtime.contexts import (
    DTYPES,
    JUDGE,
    POLICY,
    ContextSpec,
    TrainContext,
    build_model,
    publish_checkpoint,
)
from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.replicated import ElasticTrainer

RESULTS = Path(__file__).parent / "results" / "shift.json"
HEAD_DIM = 64
R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN
# (from, to, policy version): one cycle; each shift starts from the role the previous one left
CYCLE: tuple[tuple[Role | None, Role, int], ...] = (
    (None, R, 0),
    (R, G, 0),
    (G, T, 0),
    (T, R, 0),
    (R, R, 1),  # weight refresh: v0 -> v1 in the same engine
    (R, T, 1),
    (T, G, 1),
    (G, R, 1),
)
PART_KEYS = (
    "load_s",
    "alloc_s",
    "build_s",
    "engine_s",
    "release_rollout_s",
    "trainer_s",
    "opt_restore_s",
    "release_train_s",
)


def pair_name(src: Role | None, dst: Role) -> str:
    return f"{src.value if src else 'none'}->{dst.value}"


def config_for(params: int, vocab: int, bos: int | None, eos: list[int]) -> ModelConfig:
    """A Qwen2-style decoder of about ``params`` parameters: head_dim 64, 1-2 KV heads, MLP 5h, depth by size."""
    layers = 4 if params <= 4 * 10**6 else 8 if params <= 40 * 10**6 else 12

    def make(h: int) -> ModelConfig:
        heads = h // HEAD_DIM
        return ModelConfig(
            architecture="Qwen2ForCausalLM",
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=5 * h,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=2 if heads % 2 == 0 else 1,
            head_dim=HEAD_DIM,
            qkv_bias=True,
            max_position_embeddings=1024,
            bos_token_id=bos,
            eos_token_id=eos,
        )

    return min((make(h) for h in range(HEAD_DIM, 8192, HEAD_DIM)), key=lambda c: abs(c.num_parameters() - params))


# -- what runs on the device (this process, or a Ray actor) -----------------------------------------------------------
class Device:
    """A Worker that shifts through the cycle, and the parts of a shift timed alone, in the device's process."""

    def __init__(self, store: ParameterStore, spec: ContextSpec, threads: int) -> None:
        torch.set_num_threads(threads)
        self.store, self.spec, self.threads = store, spec, threads
        train = resolve(JobConfig(), Hardware(torch.device(spec.device).type)).train  # (as the plan configures it)
        self.train_spec = TrainSpec(train, temperature=1.0)
        self.worker: Worker | None = None

    def reset(self) -> None:
        """A fresh worker holding no role (the start of a cycle); the previous one's context is released."""
        self.close()
        self.worker = Worker(0, self.store, self.spec, self.train_spec, time.time(), self.threads)

    def shift(self, role: Role, version: int) -> ShiftDone:
        assert self.worker is not None
        done = self.worker.shift(role, version)
        ctx = self.worker.ctx
        if isinstance(ctx, TrainContext) and not ctx.trainer.replica.trainer.optimizer.state:
            raise RuntimeError(f"shift to train v{version} did not restore optimizer state")
        return done

    def parts(self, reps: int) -> tuple[dict[str, list[float]], int]:
        """Each piece of a shift alone (first repeat dropped), and the KV cache's bytes; see the module docstring."""
        self.close()  # no context held
        store, cpu, dtype = self.store, torch.device(self.spec.device), DTYPES[self.spec.policy_dtype]
        warm, _ = build_model(store.fetch(POLICY, 0), cpu, dtype)
        out: dict[str, list[float]] = {k: [] for k in PART_KEYS}
        kv_bytes = 0
        for rep in range(reps + 1):
            clock = _Clock()
            store.fetch(POLICY, rep % 2).load_into(warm)
            clock.lap("load_s")
            with torch.device("meta"):
                bare = Decoder(warm.config)
            bare = bare.to_empty(device=cpu).to(dtype)  # what build_model allocates, left unfilled
            clock.lap("alloc_s")
            del bare
            gc.collect()

            clock.restart()
            model, _ = build_model(store.fetch(POLICY, 0), cpu, dtype)
            clock.lap("build_s")
            engine = Engine(model, self.spec.max_batch, self.spec.max_len)
            clock.lap("engine_s")
            kv_bytes = engine.cache.nbytes
            engine.cache = None  # type: ignore[assignment]  # as GenerationContext.release
            del engine, model
            clock.lap("release_rollout_s")

            model, _ = build_model(store.fetch(POLICY, 0), cpu, dtype)
            clock.restart()
            for p in model.parameters():
                p.requires_grad_(True)
            trainer = ElasticTrainer(GRPOTrainer(model, self.train_spec.cfg, 1.0), version=0)
            clock.lap("trainer_s")
            trainer.import_state(store, POLICY, 0, weights=False)
            clock.lap("opt_restore_s")
            del trainer, model
            clock.lap("release_train_s")
            gc.collect()
            if rep > 0:
                for k, v in clock.laps.items():
                    out[k].append(v)
        del warm
        gc.collect()
        return out, kv_bytes

    def close(self) -> None:
        if self.worker is not None and self.worker.ctx is not None:
            self.worker.ctx.release()
        self.worker = None
        gc.collect()


class _Clock:
    """Named laps: each lap is the time since the previous lap (or restart)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.t = now - self.t, now


# -- driver -----------------------------------------------------------------------------------------------------------
def publish_all(store: ParameterStore, cfg: ModelConfig, seed: int) -> tuple[dict[str, float], int]:
    """Policy v0, v1 (+ AdamW state of each, from fake steps) and the judge: (publish seconds by item, parameters)."""
    tok = char_tokenizer()
    torch.manual_seed(seed)
    policy, judge = Decoder(cfg), Decoder(cfg)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4, foreach=False)
    out: dict[str, float] = {}
    for v in (0, 1):
        for p in policy.parameters():
            p.grad = p.detach() * 1e-3  # any gradient: the step only has to create exp_avg / exp_avg_sq
        opt.step()
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        publish_checkpoint(store, POLICY, v, policy, tok)
        out[f"policy_v{v}_s"] = time.perf_counter() - start
        out[f"optimizer_v{v}_s"] = publish_optimizer(store, POLICY, v, opt, policy).seconds
    start = time.perf_counter()
    publish_checkpoint(store, JUDGE, 0, judge, tok)
    out["judge_s"] = time.perf_counter() - start
    return out, sum(p.numel() for p in policy.parameters())


def free_all(store: ParameterStore) -> None:
    for name, kind in ((POLICY, Kind.WEIGHTS), (POLICY, Kind.OPTIMIZER), (JUDGE, Kind.WEIGHTS)):
        store.retain(name, 0, kind)


def measure(backend: str, store: ParameterStore, size: int, cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """Publish, then run ``repeats + 1`` cycles and the parts on a Device (here, or in a Ray actor)."""
    publish, params = publish_all(store, cfg, args.seed)
    weight_bytes = store.fetch(POLICY, 0).nbytes
    opt_bytes = store.fetch(POLICY, 0, Kind.OPTIMIZER).nbytes
    if backend == "ray":
        actor = ray.remote(Device).options(num_cpus=1).remote(store, args.spec, args.threads)

        def call(method: str, *a: Any) -> Any:
            return ray.get(getattr(actor, method).remote(*a))

    else:
        device = Device(store, args.spec, args.threads)

        def call(method: str, *a: Any) -> Any:
            return getattr(device, method)(*a)

    runs: dict[str, list[dict]] = {pair_name(s, d): [] for s, d, _ in CYCLE}
    try:
        call("reset")  # Ray actor up before timing
        # rep 0 warms up (lazy imports, first-touch of the allocator's arenas) and is dropped
        for rep in range(args.repeats + 1):
            call("reset")
            for src, dst, version in CYCLE:
                start = time.perf_counter()
                done: ShiftDone = call("shift", dst, version)
                wall = time.perf_counter() - start
                if rep > 0:
                    runs[pair_name(src, dst)].append({"seconds": done.seconds, "wall_s": wall, "bytes": done.nbytes})
        call("close")
        parts, kv_bytes = call("parts", args.repeats)
    finally:
        if backend == "ray":
            ray.kill(actor)
        free_all(store)
        gc.collect()

    part_med = {k: statistics.median(v) for k, v in parts.items()}
    load_gb_s = weight_bytes / part_med["load_s"] / 1e9
    pairs = {}
    for name, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        nbytes = rs[0]["bytes"]
        med = statistics.median(secs)
        pairs[name] = {
            "bytes": nbytes,
            "median_s": med,
            "max_s": max(secs),
            "wall_median_s": statistics.median(r["wall_s"] for r in rs),
            "wall_max_s": max(r["wall_s"] for r in rs),
            "gb_s": nbytes / med / 1e9,
            "load_share": nbytes / (load_gb_s * 1e9) / med,
            "runs": rs,
        }
    return {
        "backend": backend,
        "target_params": size,
        "params": params,
        "config": {
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
        },
        "weight_bytes": weight_bytes,
        "optimizer_bytes": opt_bytes,
        "kv_cache_bytes": kv_bytes,
        "publish_s": publish,
        "parts": {"median": part_med, "max": {k: max(v) for k, v in parts.items()}, "runs": parts},
        "load_gb_s": load_gb_s,
        "pairs": pairs,
    }


def print_table(results: list[dict]) -> None:
    head = ("backend", "params", "pair", "bytes", "median s", "max s", "wall s", "GB/s", "load %")
    rows = []
    for r in results:
        for name, p in r["pairs"].items():
            rows.append(
                (
                    r["backend"],
                    f"{r['params'] / 1e6:.1f}M",
                    name,
                    f"{p['bytes'] / 1e6:.0f} MB",
                    f"{p['median_s']:.4f}",
                    f"{p['max_s']:.4f}",
                    f"{p['wall_median_s']:.4f}",
                    f"{p['gb_s']:.2f}",
                    f"{100 * p['load_share']:.0f}",
                )
            )
    _table(head, rows, left=3)


def print_parts(results: list[dict]) -> None:
    head = ("backend", "params", "weights", "KV cache", "load GB/s", *(k.removesuffix("_s") + " ms" for k in PART_KEYS))
    rows = []
    for r in results:
        m = r["parts"]["median"]
        rows.append(
            (
                r["backend"],
                f"{r['params'] / 1e6:.1f}M",
                f"{r['weight_bytes'] / 1e6:.0f} MB",
                f"{r['kv_cache_bytes'] / 1e6:.0f} MB",
                f"{r['load_gb_s']:.2f}",
                *(f"{m[k] * 1e3:.1f}" for k in PART_KEYS),
            )
        )
    _table(head, rows, left=2)


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]], left: int) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(fmt(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(fmt(r))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default=None, help="1M,25M,100M")
    ap.add_argument("--repeats", type=int, default=5, help="timed cycles (one more warms up)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads on the device")
    ap.add_argument("--max-batch", type=int, default=ContextSpec().max_batch, help="engine slots (KV cache rows)")
    ap.add_argument("--max-len", type=int, default=ContextSpec().max_len, help="engine max sequence length")
    ap.add_argument("--ray", action="store_true", help="also run the worker in a Ray actor over a RayStore")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smallest size only, 2 cycles (< 30 s)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/shift.json; temp if --quick)")
    args = ap.parse_args()
    if args.sizes is None:
        args.sizes = [10**6, 25 * 10**6, 100 * 10**6]
    if args.quick:
        args.sizes, args.repeats = [min(args.sizes)], min(args.repeats, 2)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "pivotrl-shift-quick.json" if args.quick else RESULTS
    for name in ("repeats", "threads", "max_batch", "max_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(s < 10**5 for s in args.sizes):
        ap.error(f"--sizes must be >= 100K parameters each, got {args.sizes}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tok = char_tokenizer()
    configs = [config_for(s, tok.vocab_size, tok.bos_token_id, list(tok.eos_token_ids)) for s in args.sizes]
    args.spec = ContextSpec(max_batch=args.max_batch, max_len=args.max_len)
    load_at_start = list(os.getloadavg())
    stores: dict[str, ParameterStore] = {"local": LocalStore()}
    store_memory = 0
    if args.ray:
        # policy v0, v1 + judge (3 x 4P) and AdamW state of v0, v1 (2 x 8P), plus a staged publish argument (8P)
        store_memory = max(512 * 1024**2, int(1.25 * 36 * max(c.num_parameters() for c in configs)))
        start = time.perf_counter()
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=store_memory,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _system_config={"preallocate_plasma_memory": True},
        )
        stores["ray"] = RayStore.create("shift-bench")
        ray.get(stores["ray"].directory.memory.remote())  # directory up before timing
        print(f"ray up in {time.perf_counter() - start:.1f} s, object store {store_memory / 2**30:.1f} GiB")
    results = []
    try:
        for backend, store in stores.items():
            for size, cfg in zip(args.sizes, configs, strict=True):
                start = time.perf_counter()
                results.append(measure(backend, store, size, cfg, args))
                r = results[-1]
                print(f"  {backend} {r['params'] / 1e6:.1f}M: {time.perf_counter() - start:.1f} s")
    finally:
        if args.ray:
            stores["ray"].shutdown()  # type: ignore[attr-defined]
            ray.shutdown()

    print(
        f"Qwen2-style fp32 decoders (head_dim {HEAD_DIM}, vocab {tok.vocab_size}), engine {args.max_batch} slots x "
        f"{args.max_len} tokens, median of {args.repeats} cycles, torch threads {args.threads}, "
        f"load average at start {load_at_start[0]:.2f}"
    )
    print("median/max s = ShiftDone.seconds; wall s = outer timer around the call (Ray: + round trip); ")
    print("GB/s = bytes / median; load % = share of the median that loading the bytes at the 'load' rate takes")
    print_table(results)
    print("\nparts of a shift, each alone (median):")
    print_parts(results)
    spec = asdict(args.spec)
    report = {
        "benchmark": "shift",
        "quick": args.quick,
        "setup": {
            "sizes": args.sizes,
            "repeats": args.repeats,
            "threads": args.threads,
            "context_spec": spec,
            "cycle": [[pair_name(s, d), v] for s, d, v in CYCLE],
            "backends": list(stores),
            "ray_object_store_bytes": store_memory,
            "ray_prefault": True,
        },
        "versions": {"torch": torch.__version__, "ray": ray.__version__, "numpy": np.__version__},
        "machine": machine(load_at_start),
        "results": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
