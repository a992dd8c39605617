"""The counter-based logits processor in its element-wise form: the baseline of the ``sampling`` sections of
``benchmarks/engine.py`` and ``benchmarks/gpu_check.py``. Not used by pivotrl.

About 30 passes over [batch, vocab] in int64 and float64 (a 32-bit hash split into 16-bit products so that no
int64 product overflows, Gumbel noise in float64), a full ``-inf`` tensor built per step, the rows' parameters
sent from Python lists and the log-probs read back with ``.tolist()`` inside ``apply``: each of those waits for
the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pivotrl.engine import vllm_engine

_M32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32(x: Tensor, c: int) -> Tensor:
    lo, hi = x & 0xFFFF, x >> 16
    return (((hi * c) & _M32) << 16) + lo * c & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_B)
    return x ^ (x >> 16)


_vocab_keys: dict[tuple[int, str], Tensor] = {}


def _vocab_key(vocab: int, device: torch.device) -> Tensor:
    key = (vocab, str(device))
    if key not in _vocab_keys:
        _vocab_keys[key] = _mix32(_mul32(torch.arange(vocab, dtype=torch.int64, device=device) + 1, _GOLDEN))
    return _vocab_keys[key]


def _uniforms(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    s = _mix32(seeds.to(torch.int64) ^ _mix32(seeds.to(torch.int64) >> 32))
    sp = _mix32(s ^ _mix32(_mul32(positions.to(torch.int64) & _M32, _GOLDEN) + 0x632BE5AB))
    bits = _mix32(sp[:, None] ^ _vocab_key(vocab, seeds.device)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def _filter_logits(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    vocab = scaled.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        probs, order = scaled.softmax(-1).sort(dim=-1, descending=True, stable=True)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[Tensor, Tensor]:
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        gumbel = -torch.log(-torch.log(_uniforms(seeds, positions, logits.shape[-1])))
        drawn = (_filter_logits(scaled, top_k, top_p).double() + gumbel).argmax(-1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def processor_class() -> type:
    """The processor class, built as vLLM builds the backend's (a subclass of vLLM's ``LogitsProcessor``)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ElementWiseSampling(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.rows: dict[int, tuple[Any, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            for row in batch_update.removed:
                self.rows.pop(row, None)
            for row, params, _prompt, output in batch_update.added:
                draw = (params.extra_args or {}).get(vllm_engine._KEY)
                if draw is None:
                    self.rows.pop(row, None)
                else:
                    self.rows[row] = (draw, output)
            for a, b, how in batch_update.moved:
                ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
                if ra is not None:
                    self.rows[b] = ra
                if rb is not None and how.name == "SWAP":
                    self.rows[a] = rb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            rows = [r for r in sorted(self.rows) if r < logits.shape[0]]
            if not rows:
                return logits
            draws = [self.rows[r][0] for r in rows]
            positions = [d.offset + len(self.rows[r][1]) for r, d in zip(rows, draws, strict=True)]
            dev = logits.device
            index = torch.tensor(rows, device=dev)
            tokens, logprobs = sample(
                logits[index],
                torch.tensor([d.seed for d in draws], device=dev),
                torch.tensor(positions, device=dev),
                torch.tensor([d.temperature for d in draws], device=dev),
                torch.tensor([d.top_k for d in draws], device=dev),
                torch.tensor([d.top_p for d in draws], device=dev),
            )
            for d, pos, lp in zip(draws, positions, logprobs.tolist(), strict=True):
                vllm_engine._LOGPROBS.setdefault(d.channel, {})[(d.uid, pos)] = lp
            forced = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=dev)
            forced.scatter_(1, tokens[:, None], 0.0)
            logits[index] = forced
            return logits

    return ElementWiseSampling
