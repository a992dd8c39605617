"""The transfer sections: a GPS version loaded onto the device (from a LocalStore and from Ray's object store)
through the process's staging buffer, against a plain page-locked copy of the same bytes (bytes over the
host-to-device bandwidth: the physical limit), and ``Worker.shift`` through every role pair a step makes."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Any

from pivotrl.gpucheck.shapes import QWEN2_05B, Shape, gb, peak_memory, random_state, reset_peak, sig, timed


def _load_timings(store: Any, name: str, shape: Shape, device: str, repeats: int) -> dict[str, Any]:
    """Loads of version 0 of ``name`` as a device makes them, into an fp32 and a bf16 copy: fetched, loaded
    (on a GPU through the process's page-locked staging buffer), dropped. Then from a snapshot held and
    page-locked in place (``in_place``; the one-off registration timed apart)."""
    import torch

    from pivotrl.gps_transfer import PINS, STAGING
    from pivotrl.model import Decoder

    cuda = device.startswith("cuda")
    out: dict[str, Any] = {}
    nbytes = store.fetch(name, 0).nbytes
    probe = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    for dtype in ("float32", "bfloat16"):
        target = Decoder.empty(shape.model_config(), device, getattr(torch, dtype))
        runs = [timed(device, lambda target=target: store.fetch(name, 0).load_into(target)) for _ in range(repeats)]
        stored = store.fetch(name, 0).tensors
        ok = all(
            torch.equal(dict(target.named_parameters())[k].cpu(), stored[k].to(getattr(torch, dtype))) for k in probe
        )
        med = statistics.median(runs)
        out[dtype] = {
            "first_s": sig(runs[0]),
            "median_s": sig(med),
            "gb_per_s": sig(nbytes / med / 1e9),
            "correct": ok,
        }
        del target
    out["staging_bytes"] = STAGING.capacity if cuda else 0  # two buckets, whatever the version's size
    out["staging_pinned"] = STAGING.pinned if cuda else False
    held = store.fetch(name, 0)  # held throughout, as a caller of Snapshot.pin would: registered once
    t0 = time.perf_counter()
    out["pinned"] = held.pin()
    out["pin_seconds"] = sig(time.perf_counter() - t0)
    out["pinned_bytes"] = PINS.registered_bytes if cuda else 0
    fp32 = Decoder.empty(shape.model_config(), device, torch.float32)
    runs = [timed(device, lambda fp32=fp32: store.fetch(name, 0).load_into(fp32)) for _ in range(repeats)]
    med = statistics.median(runs)
    out["in_place"] = {"median_s": sig(med), "gb_per_s": sig(nbytes / med / 1e9)}
    del held, fp32
    return out


def _plain_copy(nbytes: int, device: str, repeats: int) -> dict[str, Any]:
    """The physical limit: page-locked host bytes to the device, one copy; and the same from pageable memory."""
    import torch

    cuda = device.startswith("cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        runs = [timed(device, lambda src=src: dst.copy_(src, non_blocking=cuda)) for _ in range(repeats)]
        med = statistics.median(runs)
        out[name] = {"median_s": sig(med), "gb_per_s": sig(nbytes / med / 1e9)}
    return out


def gps_load(device: str, shape: Shape = QWEN2_05B, repeats: int = 5) -> dict[str, Any]:
    """fetch + load_into from a LocalStore against a plain page-locked copy of the same bytes."""
    from pivotrl.gps import LocalStore

    store = LocalStore()
    store.publish("policy", 0, random_state(shape))
    nbytes = store.memory()["policy"]
    out: dict[str, Any] = {"version_gb": gb(nbytes), "store": "local"}
    out["plain_copy"] = _plain_copy(nbytes, device, repeats)
    out |= _load_timings(store, "policy", shape, device, repeats)
    plain = out["plain_copy"]["pinned"]["median_s"]
    out["ratio_fp32"] = sig(plain / out["float32"]["median_s"])  # 1.0 = as fast as the plain copy
    out["ratio_bf16"] = sig(plain / out["bfloat16"]["median_s"])
    out["pass"] = out["float32"]["correct"] and out["bfloat16"]["correct"]
    return out


def gps_load_ray(device: str, shape: Shape = QWEN2_05B, repeats: int = 5) -> dict[str, Any]:
    """The same load from Ray's object store (started here, prefaulted, just large enough)."""
    import ray

    from pivotrl.gps import RayStore

    state = random_state(shape)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    started = not ray.is_initialized()
    store_bytes = max(int(2.5 * nbytes), 256 * 2**20)
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=store_bytes,
            _system_config={"preallocate_plasma_memory": True},
        )
    store = RayStore.create(f"gpu-check-{os.getpid()}")
    try:
        store.publish("policy", 0, state)
        del state
        out: dict[str, Any] = {"version_gb": gb(nbytes), "store": "ray"}
        out["object_store_gb"] = gb(store_bytes) if started else None  # (preallocated)
        out |= _load_timings(store, "policy", shape, device, repeats)
        out["pass"] = out["float32"]["correct"] and out["bfloat16"]["correct"]
        return out
    finally:
        store.shutdown()
        if started:
            ray.shutdown()


def shifts(device: str, shape: Shape = QWEN2_05B, cycles: int = 2) -> dict[str, Any]:
    """``Worker.shift`` through every role pair a step produces, on ``device``, from a LocalStore."""
    import torch

    threads = torch.get_num_threads()  # a Worker sets the process's torch threads; given back at the end
    try:
        return _shift_cycles(device, shape, cycles)
    finally:
        torch.set_num_threads(threads)


def _shift_cycles(device: str, shape: Shape, cycles: int) -> dict[str, Any]:
    import torch

    from pivotrl.config import JobConfig
    from pivotrl.control.messages import Role
    from pivotrl.gps import LocalStore, publish_optimizer
    from pivotrl.model import Decoder, char_tokenizer
    from pivotrl.resolve import Hardware, resolve
    from pivotrl.runtime.contexts import JUDGE, POLICY, ContextSpec, publish_checkpoint
    from pivotrl.runtime.worker import TrainSpec, Worker
    from pivotrl.train.config import TrainConfig
    from pivotrl.train.grpo import GRPOTrainer

    cuda = device.startswith("cuda")
    store, tok = LocalStore(), char_tokenizer()
    model = Decoder.empty(shape.model_config(), device, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    publish_checkpoint(store, POLICY, 0, model, tok)
    publish_checkpoint(store, JUDGE, 0, model, tok)
    optimizer = GRPOTrainer(model, TrainConfig()).optimizer
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # AdamW state, as a device leaving train would have parked it
    publish_checkpoint(store, POLICY, 1, model, tok)
    publish_optimizer(store, POLICY, 1, optimizer, model)
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    low = "bfloat16" if cuda else "float32"
    spec = ContextSpec(device=device, rollout_dtype=low, judge_dtype=low, max_batch=64, max_len=512, judge_max_len=512)
    train = resolve(JobConfig(), Hardware(torch.device(device).type)).train  # (as the plan configures a device)
    worker = Worker(0, store, spec, TrainSpec(train, 1.0), origin=time.time(), threads=torch.get_num_threads())
    cycle = [
        (Role.ROLLOUT, 0), (Role.JUDGE, 0), (Role.TRAIN, 0), (Role.ROLLOUT, 0),
        (Role.ROLLOUT, 1), (Role.TRAIN, 1), (Role.JUDGE, 1), (Role.ROLLOUT, 1),
    ]  # fmt: skip
    pairs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(cycles):
        for role, version in cycle:
            before = worker.role.value if worker.role else "none"
            reset_peak(device)
            seconds = timed(device, lambda role=role, version=version: worker.shift(role, version))
            done = worker.slices[-1]
            pairs.setdefault(f"{before}->{role.value}", []).append(
                {
                    "seconds": sig(seconds),
                    "worker_seconds": sig(done.end - done.start),
                    "bytes": done.args["bytes"],
                    "held_gb_after": gb(torch.cuda.memory_allocated()) if cuda else None,
                    "peak_gb": gb(peak_memory(device)),
                }
            )
    rows = {}
    for pair, runs in pairs.items():
        warm = runs[1:] or runs  # the first of each pair warms up (CUDA, allocator, kernels), when there are more
        rows[pair] = {
            "median_s": sig(statistics.median(r["seconds"] for r in warm)),
            "gb": gb(warm[0]["bytes"]),
            "held_gb_after": warm[-1]["held_gb_after"],
            "peak_gb": max((r["peak_gb"] or 0) for r in warm) or None,
            "runs": runs,
        }
    return {"shape": asdict(shape), "rollout_dtype": low, "pairs": rows}
