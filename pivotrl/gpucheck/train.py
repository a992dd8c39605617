"""The training sections: the FSDP2 and ZeRO-1 trainers on one device against the plain trainer, and a short
``pivotrl train`` job with its devices sharing the GPU (or one device in process without Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pivotrl.gpucheck.shapes import (
    PARITY,
    QWEN2_05B,
    Shape,
    gb,
    peak_memory,
    random_batch,
    reset_peak,
    sig,
    timed,
    tiny_checkpoints,
)
from pivotrl.telemetry import Slice, read_events

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its examples/ and models/


def job(
    device: str,
    out: Path,
    timeout_s: float = 300.0,
    steps: int = 10,
    ray: bool | None = None,
    devices: int = 4,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``pivotrl train`` in a subprocess: ``devices`` device actors on one GPU (``1/devices`` of it each),
    shiftable mode, with ``extra`` overrides; without Ray (``ray`` None: whether it is installed), one device in
    the training process, colocated. Reports the shifts between each pair of roles and, for engines in
    processes of their own, which process built which model's engine."""
    import importlib.util

    ray = importlib.util.find_spec("ray") is not None if ray is None else ray
    bundled = all((ROOT / "models" / m / "config.json").is_file() for m in ("policy", "judge"))
    overrides = [
        f"steps={steps}",
        *((f"devices={devices}", "mode=shiftable") if ray else ("devices=1", "mode=colocated")),
    ]
    if device.startswith("cuda"):
        # (devices sharing one GPU: a train group of several goes through host memory; auto trains ZeRO-1 there)
        overrides += ["device=cuda", f"gpus_per_device={1 / devices:g}"] if ray else ["device=cuda"]
    if bundled:
        models = "bundled (models/policy, models/judge)"
    else:
        ckpt = tiny_checkpoints(out / "checkpoints")
        models = "tiny random checkpoints (models/ not built: run `make prepare` for the real job)"
        overrides += [
            f"policy.path={ckpt['policy']}", f"judge.path={ckpt['judge']}", "rollout.prompts_per_step=8",
            "rollout.group_size=4", "rollout.max_new_tokens=16", "judge.max_new_tokens=16", "eval.size=32",
            "eval.max_new_tokens=16",
        ]  # fmt: skip
    overrides += extra
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "pivotrl.cli", "train", str(ROOT / "examples/default.yaml"), *overrides]
    cmd += ["--out", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {"models": models, "command": "pivotrl " + " ".join(cmd[3:]), "seconds": sig(seconds),
                              "devices": devices if ray else 1, "ray": ray}  # fmt: skip
    result["returncode"] = proc.returncode
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
        result["pass"] = False
        return result
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    for key in ("samples_per_s", "tokens_per_s", "shifts", "wall_s"):
        if isinstance(summary.get(key), int | float):
            result[key] = sig(summary[key])
    # Ray's object store as the job configured it (a Ray run), and what the GPS held at the end
    result["object_store"] = summary.get("object_store")
    result["gps_bytes"] = summary.get("gps_bytes", {}).get("total", 0)
    result["steps"] = steps_done
    result["judge_dtype"] = summary.get("plan", {}).get("judge_dtype")  # (as the run resolved it on its devices)
    result |= shifts_and_engines(read_events(run_dir))
    result["pass"] = steps_done == steps and result["engines_alone"]
    return result


def shifts_and_engines(events: list[Slice]) -> dict[str, Any]:
    """From a run's events: the shifts between each pair of roles, and whether every process that built an
    engine built that of one model only, apart from its device's process (engine_host)."""
    shifts: dict[str, int] = {}
    models_of: dict[int, set[str]] = {}
    apart = True
    for e in events:
        if e.role != "shift" or "->" not in e.name:
            continue
        shifts[e.name] = shifts.get(e.name, 0) + 1
        if "engine_pid" in e.args:
            models_of.setdefault(e.args["engine_pid"], set()).update(e.args["engine_builds"].split(","))
            apart &= e.args["engine_pid"] != e.args["device_pid"]
    alone = apart and all(len(m) == 1 for m in models_of.values())
    return {"shifts_by_pair": shifts, "engine_processes": len(models_of), "engines_alone": alone}


def fsdp_check(device: str, shape: Shape = QWEN2_05B, sequences: int = 16, length: int = 1024) -> dict[str, Any]:
    """The sharded (FSDP2) trainer on one device: the update of a small model equals the plain trainer's in
    fp32, then one bf16 step of ``shape`` with activation checkpointing: seconds, tokens/s, peak memory."""
    import torch

    from pivotrl.runtime.contexts import release_device_memory
    from pivotrl.train import memory
    from pivotrl.train.config import TrainConfig
    from pivotrl.train.fsdp import ShardedTrainer
    from pivotrl.train.group import TrainGroup
    from pivotrl.train.grpo import GRPOTrainer

    group = TrainGroup.join(0, 1, device=device, process_group=True)
    try:
        small = PARITY.model_config()
        cfg = TrainConfig(micro_batch=4)
        torch.manual_seed(0)
        from pivotrl.model import Decoder

        plain_model = Decoder(small).to(device)
        state = {k: v.detach().cpu().clone() for k, v in plain_model.state_dict().items()}
        samples, adv = random_batch(small.vocab_size, 8, 64)
        plain = GRPOTrainer(plain_model, cfg)
        plain.train_batch(samples, adv)
        sharded = ShardedTrainer(group, small, cfg, 1.0, 0)
        from pivotrl.gps import LocalStore

        store = LocalStore()
        store.publish("policy", 0, state)
        sharded.load_weights(store.fetch("policy", 0))
        sharded.add(samples, adv)
        sharded.step()
        diff = max(
            float((p.detach().full_tensor().cpu() - q.detach().cpu()).abs().max())
            for p, q in zip(sharded.model.parameters(), plain_model.parameters(), strict=True)
        )
        del sharded, plain, plain_model
        torch.cuda.empty_cache()
        # the KL reference runs forward only: its root (embedding, head, final norm) must be sharded again after it
        from torch.distributed.tensor import DTensor

        kl = ShardedTrainer(group, small, TrainConfig(micro_batch=4, kl_coef=0.1), 1.0, 0,
                            reference=store.fetch("policy", 0))  # fmt: skip
        kl.load_weights(store.fetch("policy", 0))
        kl.add(samples, adv)
        kl.step()
        ref = kl.trainer.ref_model
        ref_root_sharded = all(isinstance(p, DTensor) for p in (ref.model.embed_tokens.weight, ref.lm_head.weight))
        del kl, ref

        big = shape.model_config()
        cfg = TrainConfig(micro_batch=4, micro_batch_tokens=8192, activation_checkpointing=True)
        reset_peak(device)
        trainer = ShardedTrainer(group, big, cfg, 1.0, 0, torch.bfloat16)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.to_local().normal_(0.0, 0.02)
        samples, adv = random_batch(big.vocab_size, sequences, length)
        trainer.add(samples, adv)
        warm = timed(device, trainer.step)
        trainer.add(samples, adv)
        seconds = timed(device, trainer.step)
        tokens = sequences * length
        parameters = sum(p.numel() for p in trainer.model.parameters())
        # a train group retired as the worker retires one: what the trainer held is handed back at once
        allocated = lambda: torch.cuda.memory_allocated() if device.startswith("cuda") else 0  # noqa: E731
        held = allocated()
        del trainer
        release_device_memory(device)
        return {
            "fp32_max_abs_vs_plain": diff,
            "ref_root_sharded": ref_root_sharded,
            "pass": diff < 1e-5 and ref_root_sharded,
            "held_before_retire_gb": gb(held),
            "left_after_retire_gb": gb(allocated()),
            "bf16_step_seconds": round(seconds, 3),
            "first_step_seconds": round(warm, 3),
            "tokens_per_s": round(tokens / seconds),
            "peak_memory_gb": gb(peak_memory(device)),
            "predicted_memory_gb": round(memory.per_device(big, "fsdp", 1, 8192, 2, True) / 1e9, 2),
            "parameters": parameters,
        }
    finally:
        group.leave()


def zero_check(device: str, shape: Shape = QWEN2_05B, sequences: int = 16, length: int = 1024) -> dict[str, Any]:
    """The ZeRO-1 trainer (``train.backend=zero``) on one device: the update of a small model equals the plain
    trainer's in fp32; then ``shape`` in bf16 with activation checkpointing, its backward timed apart from the
    optimizer step (the backward runs as groups come, the step after the last): seconds, tokens/s, peak memory."""
    import torch

    from pivotrl.model import Decoder
    from pivotrl.train import memory
    from pivotrl.train.config import TrainConfig
    from pivotrl.train.group import TrainGroup
    from pivotrl.train.grpo import GRPOTrainer
    from pivotrl.train.zero import ZeroTrainer

    group = TrainGroup.join(0, 1, device=device)
    small = PARITY.model_config()
    cfg = TrainConfig(micro_batch=4)
    torch.manual_seed(0)
    plain_model = Decoder(small).to(device)
    copy = Decoder(small).to(device)
    copy.load_state_dict(plain_model.state_dict())
    samples, adv = random_batch(small.vocab_size, 8, 64)
    GRPOTrainer(plain_model, cfg).train_batch(samples, adv)
    zero = ZeroTrainer(copy, cfg, 1.0, 0)
    zero.accumulate(samples, adv)
    zero.bind(group)
    zero.load_weights(None)
    zero.step()
    diff = max(float((p - q).abs().max()) for p, q in zip(copy.parameters(), plain_model.parameters(), strict=True))
    del zero, plain_model, copy
    torch.cuda.empty_cache()

    big = shape.model_config()
    cfg = TrainConfig(micro_batch=4, micro_batch_tokens=8192, activation_checkpointing=True)
    reset_peak(device)
    model = Decoder.empty(big, device, torch.bfloat16)
    model.checkpoint_layers = True
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    trainer = ZeroTrainer(model, cfg, 1.0, 0)
    samples, adv = random_batch(big.vocab_size, sequences, length)
    warm = timed(device, lambda: trainer.accumulate(samples, adv))
    trainer.bind(group)
    trainer.load_weights(None)
    trainer.step()
    backward = timed(device, lambda: trainer.accumulate(samples, adv))
    step = timed(device, lambda: trainer.step())
    tokens = sequences * length
    return {
        "fp32_max_abs_vs_plain": diff,
        "pass": diff < 1e-5,
        "bf16_backward_seconds": round(backward, 3),
        "first_backward_seconds": round(warm, 3),
        "optimizer_step_seconds": round(step, 3),
        "tokens_per_s": round(tokens / backward),
        "peak_memory_gb": gb(peak_memory(device)),
        "predicted_memory_gb": round(memory.per_device(big, "zero", 1, 8192, 2, True) / 1e9, 2),
        "parameters": trainer.numel,
    }


def vllm_job(device: str, out: Path, timeout_s: float = 300.0, steps: int = 6) -> dict[str, Any]:
    """Two devices sharing one GPU, the policy and the judge on vLLM, shiftable, at temperature 1: every engine
    in a process of its own (engine_host), and shifts between rollout and judge both ways at least twice each,
    each waking an engine asleep (built on its device's first visit only)."""
    extra = ("rollout.backend=vllm", "judge.backend=vllm", "rollout.temperature=1.0")
    result = job(device, out, timeout_s, steps=steps, devices=2, extra=extra)
    pairs = result.get("shifts_by_pair", {})
    result["both_ways"] = pairs.get("rollout->judge", 0) >= 2 and pairs.get("judge->rollout", 0) >= 2
    result["pass"] = bool(result["pass"] and result["both_ways"])
    return result


def tensor_parallel_job(device: str, out: Path, gpus: int, timeout_s: float = 300.0, steps: int = 4
                        ) -> dict[str, Any]:  # fmt: skip
    """Instances of two GPUs (two instances where the machine has four GPUs, else one), whole GPUs per device,
    the policy and the judge on vLLM with tensor parallel over each instance's GPUs (NCCL), shiftable: every
    step done, every engine rank in a process of its own serving one model."""
    devices = 4 if gpus >= 4 else 2
    extra = ("rollout.backend=vllm", "judge.backend=vllm", "rollout.temperature=1.0", "tensor_parallel=2",
             "gpus_per_device=1")  # fmt: skip
    result = job(device, out, timeout_s, steps=steps, devices=devices, extra=extra)
    result["instances"] = devices // 2
    return result


def _lose_a_rank(rank: int, port: int, device: str, lost: Any, out: Any) -> None:
    """One rank of ``member_lost``: rank 1 dies after the first collective; rank 0 goes on reducing until its
    collective fails, a thread of its own aborting the group once the parent says rank 1 is gone (as the driver's
    ``abandon`` does)."""
    import threading

    import torch

    from pivotrl.train.group import TrainGroup

    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    group = TrainGroup.join(rank, 2, "127.0.0.1", port, device=dev, timeout_s=60.0)
    x = torch.ones(1 << 20, device=dev)
    group.all_reduce_(x)
    if device == "cuda":
        torch.cuda.synchronize()
    if rank == 1:
        os._exit(1)
    watcher = threading.Thread(target=lambda: (lost.wait(), group.abort()), daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    try:
        for _ in range(100_000):
            group.all_reduce_(x)
            if device == "cuda":
                torch.cuda.synchronize()
        out.put({"failed": False})
    except Exception as e:
        out.put({"failed": True, "error": f"{type(e).__name__}: {str(e)[:200]}", "seconds": time.perf_counter() - t0})


def member_lost(device: str) -> dict[str, Any]:
    """Two ranks of a train group, one GPU each (NCCL takes one rank per GPU: two on one GPU fail when the
    communicator is made), rank 1 killed: rank 0's collective must fail within seconds, its process kept, once
    the group is aborted (``TrainGroup.abort``), not at its timeout. On a CPU the same with gloo."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    lost, out = ctx.Event(), ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [ctx.Process(target=_lose_a_rank, args=(r, port, device, lost, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    ranks[1].join(timeout=120)
    lost.set()
    t0 = time.perf_counter()
    try:
        result = out.get(timeout=90)
    except Exception:
        result = {"failed": False, "error": "rank 0 reported nothing within 90 s"}
    ranks[0].join(timeout=30)
    result["after_loss_s"] = sig(time.perf_counter() - t0)
    result["rank0_exit"] = ranks[0].exitcode
    for p in ranks:
        if p.is_alive():
            p.kill()
    result["pass"] = bool(result["failed"] and result["after_loss_s"] < 30 and ranks[0].exitcode == 0)
    return result
