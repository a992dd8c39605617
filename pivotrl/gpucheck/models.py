"""The model sections: logits parity with transformers, the native engine's tokens/s against
``transformers.generate``, and the vLLM backend beside the native engine (swap, sleep, wake, a train group)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from typing import Any

from pivotrl.gpucheck.shapes import (
    ENGINE_WORK,
    PARITY,
    QWEN2_05B,
    Shape,
    Workload,
    gb,
    peak_memory,
    random_state,
    reset_peak,
    sig,
    timed,
)


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


def engine_throughput(
    device: str, shape: Shape = QWEN2_05B, work: Workload = ENGINE_WORK, dtype: str = "bfloat16"
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


def vllm_backend(
    device: str, shape: Shape = QWEN2_05B, work: Workload = ENGINE_WORK, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """vLLM beside the native engine on the same weights and requests (greedy), then a version swapped in place,
    a sleep/wake cycle, and a second engine in the same process refused (one sleep-mode allocator per process)."""
    import torch

    from pivotrl.engine import Engine, SamplingParams, SeqState
    from pivotrl.engine.vllm_engine import VllmEngine
    from pivotrl.gps import Kind, LocalStore
    from pivotrl.model import Decoder

    td = getattr(torch, dtype)
    store = LocalStore()
    for version in (0, 1):
        state = random_state(shape, "float32")
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
        # a second engine in this process is refused, in one line, before vLLM's allocator asserts (one sleep-mode
        # allocator per process: each engine runs in a process of its own, engine_host)
        try:
            VllmEngine(shape.model_config(), td, torch.device(device), 4, max_len).close()
            result["second_engine_refused"] = not device.startswith("cuda")  # (a CPU allows it: no sleep mode)
        except RuntimeError as e:
            result["second_engine_refused"] = "alone in its process" in str(e)
    finally:
        engine.close()
    result["pass"] = bool(result["after_wake_equal"] and result["second_engine_refused"])
    return result
