"""GPU acceptance check: what a maintainer runs on any machine with one CUDA GPU (``make gpu-check``).

Under eight minutes, each section guarded (a failure is recorded, the rest
still run), a table printed and ``benchmarks/results/gpu_check.json`` written:

a. ``parity``: logits of pivotrl's decoder against transformers on the same
   random Qwen2 checkpoint, on the GPU, in fp32 (max difference within 1e-3)
   and bf16 (our error against the fp32 reference at most 1.5x transformers'
   own bf16 error), plus the KV-cached path against the full forward.
b. ``engine``: tokens/s of the native engine against ``transformers.generate``
   on a randomly initialised Qwen2-0.5B-shaped model in bf16: 256 requests of
   mixed prompt and response lengths, 64 at a time, greedy, the same requests
   to both (transformers runs them in static batches of 64 in the same order;
   only the tokens each request asked for are counted).
c. ``gps_load``: a version of about 2 GB (the 0.5B shape in fp32) brought onto
   the GPU by ``fetch`` + ``load_into`` from a LocalStore, into an fp32 copy
   (bytes straight into the parameters) and a bf16 copy (cast on the GPU),
   against a plain page-locked host-to-device copy of the same bytes (ratio,
   GB/s); the one-off page-locking of the buffer is timed apart.
   ``gps_load_ray``: the same from Ray's object store (shared memory mapped
   into this process, registered at its first load).
d. ``shifts``: wall time of ``Worker.shift`` per role pair on device "cuda"
   with a LocalStore (0.5B-shaped policy and judge, rollout and judge in bf16),
   and the device memory held after each shift (a role's memory is released
   when it is left).
e. ``job``: ``pivotrl train examples/default.yaml steps=10 devices=4
   device=cuda gpus_per_device=0.25`` in a subprocess, four device actors
   sharing the GPU; with tiny random checkpoints and a small job when the
   bundled models are not built (``make prepare``), which the output says.
   Where Ray is not installed, one device in the training process instead
   (``devices=1 mode=colocated``): the whole job on the GPU, no actors.
f. ``fsdp``: the FSDP2 trainer on one GPU (see :func:`fsdp_check`).
g. ``vllm``: the vLLM backend on the GPU (see :func:`vllm_backend`): tokens/s
   beside the native engine on the engine section's requests, greedy
   agreement with it, a version swapped in place from the GPS (agreement on
   the new weights, seconds), sleep and wake (device memory freed, seconds),
   and an engine built while a train group holds the process's
   torch.distributed world. Skipped when vLLM is not installed.

Without CUDA it prints one line and exits 0. Nothing is downloaded. Each
section function takes the device and its sizes, so the small versions run on
a CPU in tests/benchmarks/test_gpu_check.py.

    .venv/bin/python benchmarks/gpu_check.py                 # everything
    .venv/bin/python benchmarks/gpu_check.py --only parity,gps_load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
BUDGET_S = 8 * 60
NOT_RUN = "not run"


@dataclass(frozen=True, slots=True)
class Shape:
    """A Qwen2-style decoder's size (the tests use a tiny one)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True

    def hf_config(self) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tied,
            architectures=["Qwen2ForCausalLM"],
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )

    def model_config(self) -> Any:
        from pivotrl.model import ModelConfig

        return ModelConfig.from_hf(self.hf_config().to_dict())


QWEN2_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
PARITY = Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=1024, tied=False)
TINY = Shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128)


# ---------------------------------------------------------------------------------------------------------------------
# timing


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def peak_memory(device: str) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: tiny CPU-test sizes and GPU sizes read alike in the report."""
    return float(f"{x:.{digits}g}")


def gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else sig(nbytes / 1e9)


# ---------------------------------------------------------------------------------------------------------------------
# a. logits parity


def parity(device: str, shape: Shape = PARITY, rows: int = 4, length: int = 64, seed: int = 0) -> dict[str, Any]:
    """Our decoder against transformers on one random checkpoint, in fp32 and bf16 on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    from pivotrl.model import KVCache, char_tokenizer, load_model

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(shape.hf_config(), attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)  # large weights: every parameter moves the logits
    hf = hf.float().eval()
    ids = torch.randint(0, shape.vocab, (rows, length), generator=torch.Generator().manual_seed(seed + 1))
    out: dict[str, Any] = {"shape": asdict(shape), "rows": rows, "length": length}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        hf.save_pretrained(tmp)
        char_tokenizer().save(tmp)
        ids = ids.to(device)
        reference = hf.to(device)(input_ids=ids).logits.float()  # transformers in fp32: the reference
        for dtype in ("float32", "bfloat16"):
            td = getattr(torch, dtype)
            theirs = hf.to(device, td)(input_ids=ids).logits.float()
            ours_model = load_model(tmp, dtype)[0].to(device)
            ours = ours_model(ids).float()
            cache = KVCache(ours_model.config, rows, length, td, torch.device(device))
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            lengths = torch.full((rows,), length, dtype=torch.long, device=device)
            slots = torch.arange(rows, device=device)
            cached = ours_model.forward_cached(ids, zeros, lengths, slots, cache).float()
            row: dict[str, Any] = {
                "max_abs_vs_transformers": float((ours - theirs).abs().max()),
                "ours_max_abs_err": float((ours - reference).abs().max()),
                "ours_mean_abs_err": float((ours - reference).abs().mean()),
                "transformers_max_abs_err": float((theirs - reference).abs().max()),
                "transformers_mean_abs_err": float((theirs - reference).abs().mean()),
                "cached_vs_full_max_abs": float((cached - ours[:, -1]).abs().max()),
                "logit_std": float(reference.std()),
            }
            if dtype == "float32":
                row["pass"] = row["max_abs_vs_transformers"] <= 1e-3 and row["cached_vs_full_max_abs"] <= 1e-3
            else:  # both sides round; ours must not round worse than theirs
                row["pass"] = row["ours_mean_abs_err"] <= 1.5 * row["transformers_mean_abs_err"] + 1e-4 and row[
                    "cached_vs_full_max_abs"
                ] <= 0.05 * float(reference.abs().max())
            out[dtype] = row
            del ours_model, cache
    out["pass"] = out["float32"]["pass"] and out["bfloat16"]["pass"]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# b. engine tokens/s against transformers.generate


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 256
    batch: int = 64
    prompt: tuple[int, int] = (16, 256)  # prompt tokens, uniform in [lo, hi]
    new: tuple[int, int] = (16, 256)  # tokens asked for per request, uniform in [lo, hi]
    seed: int = 0

    def make(self, vocab: int) -> list[tuple[list[int], int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        out = []
        for _ in range(self.requests):
            n = int(torch.randint(self.prompt[0], self.prompt[1] + 1, (), generator=g))
            new = int(torch.randint(self.new[0], self.new[1] + 1, (), generator=g))
            out.append((torch.randint(1, vocab, (n,), generator=g).tolist(), new))
        return out


def engine_throughput(
    device: str, shape: Shape = QWEN2_05B, work: Workload = Workload(), dtype: str = "bfloat16"
) -> dict[str, Any]:
    """Both generators on the same random model and the same requests; tokens/s of the tokens asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    from pivotrl.engine import Engine, SamplingParams, SeqState
    from pivotrl.model import Decoder

    td = getattr(torch, dtype)
    torch.manual_seed(work.seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=td).eval()
    hf.generation_config.eos_token_id = None  # no stop token: every request runs to its own length
    hf.generation_config.pad_token_id = 0
    ours = Decoder.empty(shape.model_config(), device, td)
    weights = hf.state_dict()
    if shape.tied:  # whether a tied alias is listed is transformers' business; ours lists both names
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    ours.load_state_dict(weights)
    ours.eval()
    requests = work.make(shape.vocab)
    max_len = work.prompt[1] + work.new[1]

    def run_ours(reqs: list[tuple[list[int], int]]) -> list[list[int]]:
        engine = Engine(ours, max_batch=work.batch, max_len=max_len)
        states = [SeqState(i, p, i, SamplingParams(max_new_tokens=n, temperature=0.0)) for i, (p, n) in enumerate(reqs)]
        engine.generate(states)
        return [s.output_ids for s in states]

    @torch.inference_mode()
    def run_theirs(reqs: list[tuple[list[int], int]]) -> tuple[list[list[int]], int]:
        outputs, computed = [], 0
        for i in range(0, len(reqs), work.batch):
            chunk = reqs[i : i + work.batch]
            width, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
            outputs += [row[width : width + n].tolist() for row, (_, n) in zip(gen, chunk, strict=True)]
            computed += len(chunk) * new
        return outputs, computed

    warm = requests[:2]
    run_ours([(p, 4) for p, _ in warm])
    run_theirs([(p, 4) for p, _ in warm])
    asked = sum(n for _, n in requests)
    result: dict[str, Any] = {"shape": asdict(shape), "workload": asdict(work), "dtype": dtype, "tokens": asked}
    for name, fn in (("pivotrl", run_ours), ("transformers", run_theirs)):
        reset_peak(device)
        got: Any = None

        def call(fn: Any = fn) -> None:
            nonlocal got
            got = fn(requests)

        seconds = timed(device, call)
        outputs, computed = got if name == "transformers" else (got, asked)
        assert [len(o) for o in outputs] == [n for _, n in requests], f"{name} did not generate what was asked"
        result[name] = {
            "seconds": sig(seconds),
            "tokens_per_s": round(asked / seconds, 1),
            "tokens_computed": computed,
            "peak_gb": gb(peak_memory(device)),
        }
        result[f"{name}_outputs"] = outputs
    same = sum(a == b for a, b in zip(result.pop("pivotrl_outputs"), result.pop("transformers_outputs"), strict=True))
    result["greedy_agreement"] = sig(same / len(requests))  # informational: bf16 near-ties may differ
    result["speedup"] = sig(result["pivotrl"]["tokens_per_s"] / result["transformers"]["tokens_per_s"])
    return result


# ---------------------------------------------------------------------------------------------------------------------
# g. the vLLM backend


def vllm_backend(
    device: str, shape: Shape = QWEN2_05B, work: Workload = Workload(), dtype: str = "bfloat16"
) -> dict[str, Any]:
    """vLLM beside the native engine on the same weights and requests (greedy), then a version swapped in place,
    a sleep/wake cycle, a wake beside another engine asleep and a build inside a train group."""
    import torch

    from pivotrl.engine import Engine, SamplingParams, SeqState
    from pivotrl.engine.vllm_engine import VllmEngine
    from pivotrl.gps import Kind, LocalStore
    from pivotrl.model import Decoder
    from pivotrl.train.group import TrainGroup

    td = getattr(torch, dtype)
    store = LocalStore()
    for version in (0, 1):
        state = _random_state(shape, "float32")
        if version:  # another version: the same tensors, perturbed
            state = {n: t.mul_(0.9).add_(0.05) for n, t in state.items()}
        store.publish("policy", version, state, Kind.WEIGHTS, {})
    requests = work.make(shape.vocab)
    max_len = work.prompt[1] + work.new[1]

    def states(reqs: list[tuple[list[int], int]]) -> list[SeqState]:
        return [SeqState(i, p, i, SamplingParams(max_new_tokens=n, temperature=0.0)) for i, (p, n) in enumerate(reqs)]

    def native(version: int) -> list[list[int]]:
        model = Decoder.empty(shape.model_config(), device, td)
        store.fetch("policy", version).load_into(model)
        out = Engine(model.eval(), max_batch=work.batch, max_len=max_len).generate(states(requests))
        del model
        return [s.output_ids for s in out]

    def agreement(a: list[list[int]], b: list[list[int]]) -> float:
        return sig(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))

    result: dict[str, Any] = {"shape": asdict(shape), "workload": asdict(work), "dtype": dtype}
    t0 = time.perf_counter()
    engine = VllmEngine(
        shape.model_config(), td, torch.device(device), work.batch, max_len, weights=store.fetch("policy", 0)
    )
    result["build_seconds"] = sig(time.perf_counter() - t0)
    try:
        engine.generate(states([(p, 4) for p, _ in requests[:2]]))  # warm
        got: list[SeqState] = []
        seconds = timed(device, lambda: got.extend(engine.generate(states(requests))))
        asked = sum(n for _, n in requests)
        assert [len(s.output_ids) for s in got] == [n for _, n in requests], "vllm did not generate what was asked"
        result["tokens_per_s"] = round(asked / seconds, 1)
        t0 = time.perf_counter()
        native_v0 = native(0)
        result["native_tokens_per_s"] = round(asked / (time.perf_counter() - t0), 1)
        result["greedy_agreement_v0"] = agreement([s.output_ids for s in got], native_v0)
        result["swap_seconds"] = sig(timed(device, lambda: engine.load_weights(store.fetch("policy", 1))))
        swapped = [s.output_ids for s in engine.generate(states(requests))]
        result["greedy_agreement_v1"] = agreement(swapped, native(1))
        result["changed_by_swap"] = sig(1 - agreement(swapped, [s.output_ids for s in got]))
        # the reference for after the wake: the same 16 requests alone, before the sleep (vLLM's kernels depend on
        # the batch, so the 16 inside the full batch above are no reference for the 16 alone)
        alone = [s.output_ids for s in engine.generate(states(requests[:16]))]
        free = lambda: torch.cuda.mem_get_info()[0] if device.startswith("cuda") else 0  # noqa: E731
        before = free()
        result["sleep_seconds"] = sig(timed(device, engine.sleep))
        result["freed_gb"] = gb(free() - before)
        result["wake_seconds"] = sig(
            timed(device, lambda: (engine.wake(), engine.load_weights(store.fetch("policy", 1))))
        )
        woken = [s.output_ids for s in engine.generate(states(requests[:16]))]
        result["after_wake_equal"] = woken == alone
        # a device keeps its other model's engine asleep (vLLM's sleep allocator is one per process): waking this
        # one must map back its own memory only, not the other's too
        engine.sleep()
        other = VllmEngine(shape.model_config(), td, torch.device(device), 4, max_len, weights=store.fetch("policy", 0))
        other.sleep()
        before = free()
        engine.wake()
        result["wake_beside_asleep_gb"] = gb(before - free())
        engine.load_weights(store.fetch("policy", 1))
        other.close()
        result["wake_own_only"] = result["wake_beside_asleep_gb"] <= 1.2 * result["freed_gb"] + 0.5
        group = TrainGroup.join(0, 1, "127.0.0.1", 0, device=device, process_group=True)
        try:  # a second engine built while the trainer's world is in place, the world intact after
            other = VllmEngine(
                shape.model_config(), td, torch.device(device), 4, max_len, weights=store.fetch("policy", 1)
            )
            other.close()
            result["build_in_train_group"] = group.all_reduce_(torch.ones(1, device=device)).item() == 1.0
        finally:
            group.leave()
    finally:
        engine.close()
    result["pass"] = bool(result["after_wake_equal"] and result["wake_own_only"] and result["build_in_train_group"])
    return result


# ---------------------------------------------------------------------------------------------------------------------
# c. GPS load against a plain page-locked copy


def _random_state(shape: Shape, dtype: str = "float32") -> dict[str, Any]:
    """A model's tensors on the CPU with random values, without building (and initialising) the model."""
    import torch

    from pivotrl.gps import module_tensors
    from pivotrl.model import Decoder

    with torch.device("meta"):
        skeleton = Decoder(shape.model_config())
    g = torch.Generator().manual_seed(0)
    return {
        n: torch.empty(t.shape, dtype=getattr(torch, dtype)).uniform_(-1, 1, generator=g)
        for n, t in module_tensors(skeleton).items()
    }


def _load_timings(store: Any, name: str, shape: Shape, device: str, repeats: int) -> dict[str, Any]:
    """Registration, first load and warm loads of version 0 of ``name`` into an fp32 and a bf16 copy."""
    import torch

    from pivotrl.gps_transfer import PINS
    from pivotrl.model import Decoder

    out: dict[str, Any] = {}
    held = store.fetch(name, 0)  # held throughout, as a device holds the version it serves: registered once
    nbytes = held.nbytes
    t0 = time.perf_counter()
    out["pinned"] = held.pin()
    out["pin_seconds"] = sig(time.perf_counter() - t0)
    out["pinned_bytes"] = PINS.registered_bytes if device.startswith("cuda") else 0
    for dtype in ("float32", "bfloat16"):
        target = Decoder.empty(shape.model_config(), device, getattr(torch, dtype))
        runs = [timed(device, lambda target=target: store.fetch(name, 0).load_into(target)) for _ in range(repeats)]
        stored = store.fetch(name, 0).tensors
        probe = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
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
    del held
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
    store.publish("policy", 0, _random_state(shape))
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

    state = _random_state(shape)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=max(int(2.5 * nbytes), 256 * 2**20),
            _system_config={"preallocate_plasma_memory": True},
        )
    store = RayStore.create(f"gpu-check-{os.getpid()}")
    try:
        store.publish("policy", 0, state)
        del state
        out: dict[str, Any] = {"version_gb": gb(nbytes), "store": "ray"}
        out |= _load_timings(store, "policy", shape, device, repeats)
        out["pass"] = out["float32"]["correct"] and out["bfloat16"]["correct"]
        return out
    finally:
        store.shutdown()
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------------------------------
# d. shift wall time per role pair


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

    from pivotrl.control.messages import Role
    from pivotrl.gps import LocalStore, publish_optimizer
    from pivotrl.model import Decoder, char_tokenizer
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
    worker = Worker(0, store, spec, TrainSpec(TrainConfig(), 1.0), origin=time.time(), threads=torch.get_num_threads())
    cycle = [
        (Role.ROLLOUT, 0), (Role.GENRM, 0), (Role.TRAIN, 0), (Role.ROLLOUT, 0),
        (Role.ROLLOUT, 1), (Role.TRAIN, 1), (Role.GENRM, 1), (Role.ROLLOUT, 1),
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


# ---------------------------------------------------------------------------------------------------------------------
# e. a 10-step shiftable job on 4 devices sharing the GPU


def _tiny_checkpoints(root: Path) -> dict[str, Path]:
    """A random policy and judge over the character tokenizer, as tests/conftest.py builds them."""
    import torch

    from pivotrl.model import Decoder, char_tokenizer, save_model

    tok = char_tokenizer()
    paths = {}
    for name, arch, seed in (("policy", "Qwen2ForCausalLM", 0), ("judge", "LlamaForCausalLM", 1)):
        shape = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=tok.vocab_size)
        cfg = replace(
            shape.model_config(),
            architecture=arch,
            qkv_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=tok.bos_token_id,
            eos_token_id=list(tok.eos_token_ids),
        )
        torch.manual_seed(seed)
        model = Decoder(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3)
        save_model(model, tok, root / name)
        paths[name] = root / name
    return paths


def job(device: str, out: Path, timeout_s: float = 300.0, steps: int = 10, ray: bool | None = None) -> dict[str, Any]:
    """``pivotrl train`` in a subprocess: four device actors on one GPU, shiftable mode; without Ray (``ray``
    None: whether it is installed), one device in the training process, colocated."""
    import importlib.util

    ray = importlib.util.find_spec("ray") is not None if ray is None else ray
    bundled = all((ROOT / "models" / m / "config.json").is_file() for m in ("policy", "judge"))
    overrides = [f"steps={steps}", *(("devices=4", "mode=shiftable") if ray else ("devices=1", "mode=colocated"))]
    if device.startswith("cuda"):
        # (four devices on one GPU: a train group of several goes through host memory; auto trains ZeRO-1 there)
        overrides += ["device=cuda", "gpus_per_device=0.25"] if ray else ["device=cuda"]
    if bundled:
        models = "bundled (models/policy, models/judge)"
    else:
        ckpt = _tiny_checkpoints(out / "checkpoints")
        models = "tiny random checkpoints (models/ not built: run `make prepare` for the real job)"
        overrides += [
            f"policy.path={ckpt['policy']}", f"judge.path={ckpt['judge']}", "rollout.prompts_per_step=8",
            "rollout.group_size=4", "rollout.max_new_tokens=16", "judge.max_new_tokens=16", "eval.size=32",
            "eval.max_new_tokens=16",
        ]  # fmt: skip
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "pivotrl.cli", "train", str(ROOT / "examples/default.yaml"), *overrides]
    cmd += ["--out", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {"models": models, "command": "pivotrl " + " ".join(cmd[3:]), "seconds": sig(seconds),
                              "devices": 4 if ray else 1, "ray": ray}  # fmt: skip
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
    result["steps"] = steps_done
    result["pass"] = steps_done == steps
    return result


# ---------------------------------------------------------------------------------------------------------------------
# f. the FSDP2 trainer on one GPU


def random_batch(vocab: int, n: int, size: int) -> tuple[list[Any], list[float]]:
    """``n`` random samples of ``size`` tokens, half prompt and half response, with advantages +1 and -1: what
    the trainer sections backpropagate."""
    import torch

    from pivotrl.sample import Sample

    gen = torch.Generator().manual_seed(0)
    out = []
    for uid in range(n):
        ids = torch.randint(1, vocab, (size,), generator=gen).tolist()
        lp = (-torch.rand(size // 2, generator=gen) * 5).tolist()
        out.append(Sample(uid, uid // 4, "", "", ids[: size // 2], 0, response_ids=ids[size // 2 :], logprobs=lp))
    return out, [1.0, -1.0] * (n // 2)


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


# ---------------------------------------------------------------------------------------------------------------------
# driver


def run_section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One section, guarded: its result, or what went wrong; never an exception."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except NotImplementedError as e:
        return {"status": NOT_RUN, "reason": str(e), "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # a failed section is a finding; the others still run
        return {
            "status": "failed",
            "error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
            "seconds": round(time.perf_counter() - t0, 1),
        }
    status = "ok" if result.get("pass", True) else "failed"
    return {"status": status, "result": result, "seconds": round(time.perf_counter() - t0, 1)}


def headline(name: str, section: dict[str, Any]) -> str:
    """The one line of numbers the table shows for a section."""
    r = section.get("result")
    if r is None:
        return section.get("error") or section.get("reason") or ""
    if name == "parity":
        return (
            f"fp32 max|d| {r['float32']['max_abs_vs_transformers']:.2e}; bf16 mean err ours "
            f"{r['bfloat16']['ours_mean_abs_err']:.3g} vs transformers {r['bfloat16']['transformers_mean_abs_err']:.3g}"
        )
    if name == "engine":
        return (
            f"pivotrl {r['pivotrl']['tokens_per_s']:.0f} tok/s vs transformers {r['transformers']['tokens_per_s']:.0f}"
            f" ({r['speedup']:.2f}x), greedy agreement {r['greedy_agreement']:.2f}"
        )
    if name.startswith("gps_load"):
        plain = r.get("plain_copy", {}).get("pinned", {}).get("gb_per_s")
        head = f"{r['version_gb']} GB: fp32 {r['float32']['gb_per_s']} GB/s, bf16 {r['bfloat16']['gb_per_s']} GB/s"
        head += f", pin {r['pin_seconds']} s"
        return head + (f"; plain pinned {plain} GB/s (ratio {r['ratio_fp32']}, {r['ratio_bf16']})" if plain else "")
    if name == "shifts":
        return ", ".join(f"{k} {v['median_s']:.3f}s" for k, v in r["pairs"].items())
    if name == "fsdp":
        return (
            f"fp32 vs plain max|d| {r['fp32_max_abs_vs_plain']:.1e}; bf16 step {r['bf16_step_seconds']} s, "
            f"{r['tokens_per_s']} tok/s, peak {r['peak_memory_gb']} GB (arithmetic {r['predicted_memory_gb']}); "
            f"retired {r['held_before_retire_gb']} -> {r['left_after_retire_gb']} GB; KL reference root sharded "
            f"{r['ref_root_sharded']}"
        )
    if name == "zero":
        return (
            f"fp32 vs plain max|d| {r['fp32_max_abs_vs_plain']:.1e}; bf16 backward {r['bf16_backward_seconds']} s "
            f"({r['tokens_per_s']} tok/s), optimizer step {r['optimizer_step_seconds']} s, "
            f"peak {r['peak_memory_gb']} GB (arithmetic {r['predicted_memory_gb']})"
        )
    if name == "vllm":
        return (
            f"{r['tokens_per_s']:.0f} tok/s vs native {r['native_tokens_per_s']:.0f}; greedy agreement "
            f"{r['greedy_agreement_v0']:.2f} (v1 {r['greedy_agreement_v1']:.2f}); swap {r['swap_seconds']} s, "
            f"sleep {r['sleep_seconds']} s freed {r['freed_gb']} GB, wake+load {r['wake_seconds']} s; woken beside "
            f"an engine asleep it maps {r['wake_beside_asleep_gb']} GB"
        )
    if name == "job":
        where = "4 Ray devices" if r.get("ray", True) else "1 device in process (no Ray)"
        return (f"{r.get('steps')} steps on {where} in {r['seconds']} s, {r.get('samples_per_s')} samples/s; "
                f"models: {r['models']}")  # fmt: skip
    return json.dumps(r)[:200]


def print_table(sections: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'section':<13} {'status':<8} {'s':>6}  result")
    for name, s in sections.items():
        print(f"{name:<13} {s['status']:<8} {s.get('seconds', 0):>6.1f}  {headline(name, s)[:300]}")


def machine() -> dict[str, Any]:
    import platform

    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gb": gb(props.total_memory),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


SECTIONS = ("parity", "gps_load", "gps_load_ray", "shifts", "engine", "fsdp", "zero", "vllm", "job")
# packages a section needs beyond torch, transformers and the rest every section imports (the job runs one
# device in process without Ray; the device actors' runtime and the run files it writes need orjson)
NEEDS = {
    "parity": ("transformers",),
    "engine": ("transformers",),
    "gps_load_ray": ("ray", "orjson"),
    "shifts": ("orjson",),
    "job": ("orjson", "yaml", "jinja2", "tqdm", "matplotlib"),  # (the run's config, chat template, bar, timeline)
}
PACKAGES = {"ray": "Ray", "orjson": "orjson", "transformers": "transformers", "yaml": "PyYAML", "jinja2": "Jinja2",
            "tqdm": "tqdm", "matplotlib": "matplotlib"}  # fmt: skip


def cannot_run(name: str) -> str | None:
    """Why section ``name`` cannot run with this interpreter's packages (None: it can): a GPU machine whose
    python3 holds a CUDA build of torch but cannot install more (``make gpu-check-system``) may lack Ray, vLLM
    or orjson."""
    import importlib.util

    if name == "vllm":
        try:
            from pivotrl.engine.vllm_engine import available as vllm_available
        except ImportError as e:  # (a package the backend's module needs)
            return f"the vLLM backend cannot be imported ({e})"
        if not vllm_available():
            return "vLLM is not installed (make install adds it)"
    missing = [PACKAGES[m] for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed (make install adds it)"


ESTIMATE_S = {
    "parity": 20, "gps_load": 40, "gps_load_ray": 60, "shifts": 60, "engine": 90, "fsdp": 60, "zero": 40, "vllm": 120,
    "job": 120,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON report")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; allowed: {', '.join(SECTIONS)}")

    import torch

    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, {built}); nothing to check")
        return 0

    start = time.perf_counter()
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "parity": lambda: parity(device),
        "gps_load": lambda: gps_load(device),
        "gps_load_ray": lambda: gps_load_ray(device),
        "shifts": lambda: shifts(device),
        "engine": lambda: engine_throughput(device),
        "fsdp": lambda: fsdp_check(device),
        "zero": lambda: zero_check(device),
        "vllm": lambda: vllm_backend(device),
    }
    sections: dict[str, dict[str, Any]] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(done: bool) -> float:
        """The report so far: written after every section too, so that a native crash (NCCL, an allocator's
        teardown) in a later one loses none of those before it."""
        total = time.perf_counter() - start
        report = {"machine": machine(), "total_seconds": round(total, 1), "complete": done, "sections": sections}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        return total

    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            left = BUDGET_S - (time.perf_counter() - start)
            if name == "job":
                fn: Callable[[], dict[str, Any]] = lambda left=left: job(device, Path(tmp), max(30.0, left - 20))
            else:
                fn = jobs[name]
            if left < ESTIMATE_S[name] / 2:
                sections[name] = {"status": "skipped", "reason": f"{left:.0f} s of the 8-minute budget left"}
                continue
            reason = cannot_run(name)
            if reason:
                sections[name] = {"status": "skipped", "reason": reason}
                continue
            print(f"gpu-check: {name} ...", flush=True)
            sections[name] = run_section(name, fn)
            torch.cuda.empty_cache()
            write(done=False)
    print_table(sections)
    total = write(done=True)
    print(f"wrote {args.out} ({total:.0f} s)")
    return 1 if any(s["status"] == "failed" for s in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
