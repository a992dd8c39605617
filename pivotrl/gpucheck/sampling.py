"""The sampling section: pivotrl's counter-based draw inside vLLM against vLLM's own sampler, at a real vocabulary.

Each contender is one decode step's sampling as vLLM runs it, from float32 logits to the tokens on the host
(where vLLM needs them to go on):

* ``processor``: pivotrl's logits processor run by vLLM's ``Sampler`` as the backend runs it (every request
  greedy, the processor drawing), with ``update_state`` before and the engine's read of the log-probs after;
* ``vllm``: vLLM's ``Sampler`` sampling every row at temperature 1 (``TopKTopPSampler``: on a CPU its fused
  Gumbel-max kernel, on CUDA softmax, exponential noise and argmax, or FlashInfer where a row filters);
* ``vllm seeded``: the same with a seed per request (a ``torch.Generator`` a row), vLLM's own way to make a
  request's draws reproducible - though not a migrated request's, whose generator does not move with it;
* whatever a caller adds (``benchmarks/engine.py`` adds the processor's element-wise form).

It also checks the processor's draws against the native engine's sampler on the same logits (greedy, top-k,
top-p and tempered rows mixed; the same tokens and log-probs), and, on CUDA, the uniforms' bits against the
CPU's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from pivotrl.gpucheck.shapes import sig, timed

VOCAB = 151_936
BATCHES = (64, 256)
CHANNEL = -1  # the processors' engine here: no VllmEngine of this process uses it

Step = Callable[[Any], Any]  # one step's sampling of the given logits (which it may change)
Contender = Callable[[int, Any], Step]  # (batch, device) -> step


def _metadata(batch: int, device: Any, greedy: bool, processors: tuple = (), seeded: bool = False) -> Any:
    """vLLM's SamplingMetadata for ``batch`` rows: all greedy (pivotrl's requests) or all at temperature 1."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    full = lambda v: torch.full((batch,), v, device=device)  # noqa: E731
    generators = {i: torch.Generator(device=device).manual_seed(i) for i in range(batch)} if seeded else {}
    return SamplingMetadata(
        temperature=None if greedy else full(1.0),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=full(0.0),
        presence_penalties=full(0.0),
        repetition_penalties=full(1.0),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
    )


def draws(batch: int, mixed: bool = False) -> list[Any]:
    """The requests' draws (``vllm_engine._Draw``): plain temperature 1, or every kind of row mixed."""
    from pivotrl.engine.vllm_engine import _Draw

    kinds = [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 1.0), (1.2, 0, 0.9), (0.9, 20, 0.95)]
    return [
        _Draw(CHANNEL, uid, 1000 + 7 * uid, uid % 5, *(kinds[uid % len(kinds)] if mixed else kinds[0]))
        for uid in range(batch)
    ]


def processor_step(cls: type, batch: int, device: Any, mixed: bool = False) -> Step:
    """A step of processor class ``cls`` (built as vLLM builds it) inside vLLM's greedy ``Sampler``, its rows
    added once; each step's tokens are appended to the rows' outputs, as vLLM does, and the step returns the
    log-probs the engine reads, ``(uid, position) -> log-prob``."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    from pivotrl.engine import vllm_engine

    pin = torch.device(device).type == "cuda"
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch))
    proc = cls(config, torch.device(device), pin)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    added = [(i, SimpleNamespace(extra_args={vllm_engine._KEY: d}), None, outputs[i]) for i, d in
             enumerate(draws(batch, mixed))]  # fmt: skip
    proc.update_state(SimpleNamespace(batch_size=batch, removed=[], added=added, moved=[]))
    sampler, meta = Sampler(), _metadata(batch, device, greedy=True, processors=(proc,))
    vllm_engine._LOGPROBS.setdefault(CHANNEL, {})

    def step(logits: Any) -> dict[tuple[int, int], float]:
        proc.update_state(None)
        tokens = sampler(logits, meta).sampled_token_ids.tolist()
        table = vllm_engine._collect(CHANNEL)
        vllm_engine._LOGPROBS[CHANNEL] = {}  # (the engine takes each row's log-prob out of the table)
        for out, tok in zip(outputs, tokens, strict=True):
            out.append(tok[0])
        return table

    return step


def vllm_step(batch: int, device: Any, seeded: bool = False) -> Step:
    """A step of vLLM's own ``Sampler`` at temperature 1 (per-request seeds: one generator a row)."""
    from vllm.v1.sample.sampler import Sampler

    sampler, meta = Sampler(), _metadata(batch, device, greedy=False, seeded=seeded)
    return lambda logits: sampler(logits, meta).sampled_token_ids.tolist()


def agreement(device: str, vocab: int, batch: int) -> dict[str, Any]:
    """The processor's draws and log-probs against the native engine's sampler on the same logits, every kind
    of row mixed, over a few steps (positions moving on)."""
    import torch

    from pivotrl.engine import sampling
    from pivotrl.engine.vllm_engine import _processor_class

    ds = draws(batch, mixed=True)
    step_fn = processor_step(_processor_class(), batch, device, mixed=True)
    equal, rows, worst = 0, 0, 0.0
    for step in range(3):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(step)).mul_(3).to(device)
        cols = [[d.seed for d in ds], [d.offset + step for d in ds], [d.temperature for d in ds],
                [d.top_k for d in ds], [d.top_p for d in ds]]  # fmt: skip
        want, want_lp = sampling.sample(logits, *(torch.tensor(c, device=device) for c in cols))
        processed = logits.clone()
        table = step_fn(processed)
        got_lp = torch.tensor([table[(d.uid, d.offset + step)] for d in ds])
        equal += int((processed.argmax(-1) == want).sum())
        rows += batch
        worst = max(worst, float((got_lp - want_lp.cpu()).abs().max()))
    return {"rows": rows, "tokens_equal": sig(equal / rows), "logprob_max_abs_diff": worst}


def uniforms_match_cpu(device: str, vocab: int) -> bool:
    """Whether the device's uniforms are the CPU's, bit for bit (the hash's integer passes and the exact
    conversion; the noise's logarithms may differ in the last bit between devices)."""
    import torch

    from pivotrl.engine.sampling import uniforms

    seeds = torch.tensor([0, 1, 2**33 + 5, -7, 123456789])
    positions = torch.tensor([0, 1, 77, 4000, 2**20])
    here = uniforms(seeds.to(device), positions.to(device), vocab).cpu()
    return bool(torch.equal(here, uniforms(seeds, positions, vocab)))


def sampling_check(
    device: str,
    vocab: int = VOCAB,
    batches: tuple[int, ...] = BATCHES,
    repeats: int = 5,
    others: Mapping[str, Contender] | None = None,
) -> dict[str, Any]:
    """Milliseconds per step of each contender at each batch (median of ``repeats`` after one warm-up, the
    contenders taking turns; the processor's time over vLLM's, median of the repeats' ratios), the processor's
    agreement with the native sampler, and (on CUDA) the uniforms' bits against the CPU's."""
    import torch

    from pivotrl.engine.vllm_engine import _processor_class

    contenders: dict[str, Contender] = {
        "processor": lambda b, d: processor_step(_processor_class(), b, d),
        "vllm": vllm_step,
        "vllm seeded": lambda b, d: vllm_step(b, d, seeded=True),
        **(others or {}),
    }
    result: dict[str, Any] = {"vocab": vocab, "repeats": repeats, "batches": {}}
    for batch in batches:
        source = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).mul_(3).to(device)
        logits = torch.empty_like(source)
        steps = {name: make(batch, device) for name, make in contenders.items()}
        runs: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats + 1):  # the contenders alternate, so that a busy machine slows them alike
            for name, step in steps.items():
                logits.copy_(source)
                runs[name].append(timed(device, lambda step=step, logits=logits: step(logits)))
        row: dict[str, Any] = {
            name: {"ms": sig(1e3 * statistics.median(r[1:])), "runs_ms": [sig(1e3 * x) for x in r[1:]]}
            for name, r in runs.items()
        }
        paired = [p / v for p, v in zip(runs["processor"][1:], runs["vllm"][1:], strict=True)]
        row["processor_over_vllm"] = sig(statistics.median(paired))  # (median of each repeat's ratio)
        result["batches"][str(batch)] = row
        del steps
    result["agreement"] = agreement(device, vocab, min(batches))
    result["uniforms_match_cpu"] = uniforms_match_cpu(device, vocab)
    a = result["agreement"]
    result["pass"] = a["tokens_equal"] == 1.0 and a["logprob_max_abs_diff"] == 0.0 and result["uniforms_match_cpu"]
    return result
