"""Counter-based sampling.

The random draw for a token depends only on (sequence seed, position in the
response, vocabulary index), never on batch composition, device or call
order: a stateless integer hash gives one uniform per vocabulary entry and
the Gumbel-max trick turns them into a sample. A sequence therefore yields the
same tokens whichever batch or device it runs in, and a sequence aborted on
one device and resumed on another continues exactly where it stopped.

The hash uses only 32-bit products computed in int64 (no overflow), so CPU
and GPU give bit-identical draws.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32 constants (public-domain integer hash)
_GOLDEN = 0x9E3779B9


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (((hi * c) & _M32) << 16) + lo * c & _M32


def mix32(x: Tensor) -> Tensor:
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
        _vocab_keys[key] = mix32(_mul32(torch.arange(vocab, dtype=torch.int64, device=device) + 1, _GOLDEN))
    return _vocab_keys[key]


def uniforms(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1), float64 ``[B, vocab]``, a pure function of (seed, position, index)."""
    s = mix32(seeds.to(torch.int64) ^ mix32(seeds.to(torch.int64) >> 32))
    sp = mix32(s ^ mix32(_mul32(positions.to(torch.int64) & _M32, _GOLDEN) + 0x632BE5AB))
    bits = mix32(sp[:, None] ^ _vocab_key(vocab, seeds.device)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def filter_logits(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus (top-p) set."""
    vocab = scaled.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        probs, order = scaled.softmax(-1).sort(dim=-1, descending=True, stable=True)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[Tensor, Tensor]:
    """Draw one token per row. Returns ``(tokens [B], logprobs [B])``.

    ``temperature <= 0`` is greedy. The log-prob is that of the token under the
    temperature-scaled, unfiltered distribution - the one the trainer
    recomputes - so importance ratios start at exactly 1.
    """
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        gumbel = -torch.log(-torch.log(uniforms(seeds, positions, logits.shape[-1])))
        drawn = (filter_logits(scaled, top_k, top_p).double() + gumbel).argmax(-1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
