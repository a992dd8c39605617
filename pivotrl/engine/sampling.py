"""Counter-based sampling.

The random draw for a token depends only on (sequence seed, position in the
response, vocabulary index), never on batch composition, device or call
order: a stateless integer hash gives one uniform per vocabulary entry and
the Gumbel-max trick turns them into a sample. A sequence therefore yields the
same tokens whichever batch or engine it runs in (the native engine and the
vLLM backend's logits processor call the same :func:`draw`), and a sequence
aborted on one engine and resumed on another continues exactly where it
stopped.

**The hash.** ``lowbias32`` (C. Wellons' hash-prospector; ``x ^= x >> 16;
x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``, logical shifts,
products mod 2**32) is applied four times::

    seed key  s = lowbias32(lo32(seed) ^ lowbias32(hi32(seed)))       host, once a sequence
    row key   k = lowbias32(s + position * 0x9E3779B9)                device, [batch]
    vocab key w = lowbias32((index + 1) * 0x9E3779B9)                 device, [vocab], cached
    token     y = lowbias32(k ^ w) before its last xorshift           device, [batch, vocab]
    uniform   v = (top 31 bits of y + 1/2) / 2**31, in (0, 1)
    noise     E = -log1p(-v) ~ Exp(1); the token drawn: argmax(logits / T - log E)

Every step is a bijection of 32-bit words, so within a row every vocabulary
entry gets its own word and within a sequence every position its own row key.
The last xorshift of ``lowbias32`` would only fold high bits into low ones (an
invertible map of the 31 bits kept), so it is left out. Since
``x ^ (x >> 16)`` is linear and its own inverse, ``lowbias32(k ^ w)``'s first
step is done once per row and once per vocabulary entry, not per token. The
hash runs in int32 over [batch, vocab]: torch's int32 products wrap modulo
2**32 (two's complement, on CPU and CUDA), right shifts of int32 are
arithmetic and are masked where a logical one is meant; the tests check the
bits against Python's exact integers, and ``make gpu-check`` CUDA's against the
CPU's.

**Why these bits suffice.** The race is the Gumbel-max trick written as an
exponential race, in float32: a token wins with a small E, about 1/N in a row
spread over N likely tokens. There v is exact in float32 (m < 2**23) and
``log1p`` keeps E's relative resolution, 1/m: about N * 2**-31, so two
winners share a value (a tie, which argmax gives to the lower index) in about
N * 2**-31 of the draws - 7e-5 for a row flat over all 151,936 tokens of a
Qwen vocabulary, as with 32-bit uniforms in float64. (23-bit uniforms and
``E = -log u`` would put E near 0 on a grid of 2**-23: 1.8% there.) The noise
is cut off above 22.2, an event of probability 2e-10 per token; where v rounds
to 1 (3e-8 of the tokens) E is infinite and the token cannot win, which moves
no token's chance by more than that. Greedy rows take the exact argmax of
their logits.

**Cost.** One draw is 14 element-wise passes over [batch, vocab] (int32 and
float32, most in place) plus a log-softmax for the log-prob, with no host
synchronisation: what the host must know (is any row greedy, sampled, at a
temperature other than 1, filtered) travels in :class:`Rows` beside the
device tensors, so top-k and top-p cost nothing unless a row asks for them,
and only those rows are sorted. torch.compile would fuse the passes, but it
compiles in every process that samples (each device actor, each test), once
more for every batch shape; plain torch keeps a draw the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_A, _B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_PHI = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive integers over the words


def _i32(c: int) -> int:
    """A 32-bit word as the int32 whose bits it is (torch multiplies int32 by an int32 constant)."""
    return c - (1 << 32) if c >= 1 << 31 else c


_A32, _B32, _PHI32 = _i32(_A), _i32(_B), _i32(_PHI)


# -- the hash ---------------------------------------------------------------------------------------------------


def _lowbias32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _A) & _M32
    x ^= x >> 15
    x = (x * _B) & _M32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A sequence's seed folded to a 32-bit key (an int32), computed once on the host: every bit of a 64-bit
    seed counts."""
    return _i32(_lowbias32_int((seed & _M32) ^ _lowbias32_int((seed >> 32) & _M32)))


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int32 words (torch's is arithmetic on signed types)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _lowbias32_open(x: Tensor) -> Tensor:
    """lowbias32 of int32 words without its last xorshift (a new tensor)."""
    x = x ^ _shr(x, 16)
    x = x * _A32
    x = x ^ _shr(x, 15)
    return x * _B32


def lowbias32(x: Tensor) -> Tensor:
    """lowbias32 of int32 words (bit patterns; a new tensor)."""
    x = _lowbias32_open(x)
    return x ^ _shr(x, 16)


def row_keys(seed_keys: Tensor, positions: Tensor) -> Tensor:
    """The row key of each (seed key, position), int32 ``[B]``, with lowbias32's last xorshift left out: it is
    linear and the token hash would undo it (see the module docstring)."""
    return _lowbias32_open(seed_keys.to(torch.int32) + positions.to(torch.int32) * _PHI32)


_vocab_keys: dict[tuple[int, str], Tensor] = {}
_constants: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}


def _vocab_key(vocab: int, device: torch.device) -> Tensor:
    key = (vocab, str(device))
    if key not in _vocab_keys:  # (made on the device: nothing crosses from the host, even the first time)
        _vocab_keys[key] = _lowbias32_open(torch.arange(1, vocab + 1, dtype=torch.int32, device=device) * _PHI32)
    return _vocab_keys[key]


def _affine(device: torch.device, sign: int) -> tuple[Tensor, Tensor]:
    """``sign`` * (2**-32, 2**-31) on the device: ``sign * v = c + m * s`` for the top 31 bits m of a word."""
    key = (str(device), sign)
    if key not in _constants:
        _constants[key] = (
            torch.full((), sign * 2.0**-32, device=device),
            torch.full((), sign * 2.0**-31, device=device),
        )
    return _constants[key]


class Scratch:
    """The two ``[rows, vocab]`` int32 buffers a draw works in, kept from one draw to the next. On a CPU every
    fresh buffer of that size is mapped and faulted in anew (torch keeps no cache of host memory), which costs
    as much as several passes; device memory needs none (torch's caching allocator reuses it, and hands it back
    while an engine sleeps)."""

    def __init__(self) -> None:
        self.buffers: Tensor | None = None

    def take(self, rows: int, vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
        need = rows * vocab
        if self.buffers is None or self.buffers.shape[1] < need or self.buffers.device != device:
            self.buffers = torch.empty((2, need), dtype=torch.int32, device=device)
        return self.buffers[0, :need].view(rows, vocab), self.buffers[1, :need].view(rows, vocab)


def _buffers(scratch: Scratch | None, rows: int, vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    if scratch is not None:
        return scratch.take(rows, vocab, device)
    return (torch.empty((rows, vocab), dtype=torch.int32, device=device),
            torch.empty((rows, vocab), dtype=torch.int32, device=device))  # fmt: skip


def _top31(keys: Tensor, x: Tensor, t: Tensor) -> Tensor:
    """Each token's 31 bits (``t``, int32 ``[B, vocab]``, non-negative) from row keys (:func:`row_keys`); ``x`` and
    ``t``: int32 buffers of that shape to work in. 8 passes."""
    torch.bitwise_xor(keys[:, None], _vocab_key(x.shape[1], keys.device)[None, :], out=x)
    x.mul_(_A32)
    torch.bitwise_right_shift(x, 15, out=t)
    t.bitwise_and_(0x1FFFF)
    x.bitwise_xor_(t)
    x.mul_(_B32)
    torch.bitwise_right_shift(x, 1, out=t)
    return t.bitwise_and_(0x7FFFFFFF)


def uniforms(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """The uniforms v in (0, 1), float32 ``[B, vocab]``, a pure function of (seed, position, index): the race's
    noise is ``-log(-log1p(-v))``."""
    keys = torch.tensor([seed_key(s) for s in seeds.tolist()], dtype=torch.int32, device=positions.device)
    x, t = _buffers(None, len(keys), vocab, positions.device)
    c, s = _affine(positions.device, 1)
    return torch.addcmul(c, _top31(row_keys(keys, positions), x, t), s, out=x.view(torch.float32))


def gumbel_race(scaled: Tensor, keys: Tensor, x: Tensor, t: Tensor) -> Tensor:
    """``scaled`` plus Gumbel noise, float32 ``[B, vocab]`` in ``x``'s memory (``x``, ``t``: int32 buffers of
    that shape): its argmax is a draw from ``softmax(scaled)``. Written ``scaled - log(E)`` with
    ``E = -log1p(-v)`` ~ Exp(1), which keeps v's resolution where it decides the winner (E small)."""
    m = _top31(keys, x, t)
    c, s = _affine(keys.device, -1)
    race = torch.addcmul(c, m, s, out=x.view(torch.float32))  # -v
    race.log1p_().neg_().log_()
    return torch.sub(scaled, race, out=race)


# -- the draw ---------------------------------------------------------------------------------------------------


def to_device(host: Tensor, device: torch.device, pin: bool) -> Tensor:
    """A host tensor on ``device``; with ``pin``, copied from a fresh page-locked buffer without waiting (torch's
    host allocator keeps that buffer until the copy is done), so the host never waits on the device."""
    if pin:
        host = host.pin_memory()
    return host.to(device, non_blocking=pin)


@dataclass(slots=True, frozen=True)
class Rows:
    """Each row's sampling parameters on the device, and what the host knows of them, so that a draw never
    reads the device to decide which passes to run."""

    seed_keys: Tensor  # int32 [B] (seed_key)
    positions: Tensor  # int32 [B]: index of the response token drawn
    temperature: Tensor  # float32 [B]; <= 0: greedy
    top_k: Tensor  # int32 [B]; 0: off
    top_p: Tensor  # float32 [B]; 1: off
    sampled: bool  # some row has temperature > 0
    greedy: bool  # some row has temperature <= 0
    unit_temperature: bool  # every sampled row has temperature 1 (no scaling pass)
    filtered: Tensor | None  # int64 indices of the sampled rows with a top-k or top-p; None: no such row
    top_k_max: int = 0  # the largest top-k of a filtered row (0: none)
    top_p_any: bool = False  # some filtered row has top_p < 1

    @classmethod
    def build(
        cls,
        seeds: list[int],
        positions: list[int],
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        device: torch.device,
        pin: bool = False,
    ) -> Rows:
        """From host values (an engine's sequences): the keys folded on the host, the tensors sent in one copy
        (from page-locked memory, not waited for, where ``pin``)."""
        ints = torch.tensor([[seed_key(s) for s in seeds], positions, top_k], dtype=torch.int32)
        floats = torch.tensor([temperature, top_p], dtype=torch.float32).view(torch.int32)
        on = to_device(torch.cat([ints, floats]), device, pin)
        return cls.of(on[0], on[1], on[3].view(torch.float32), on[2], on[4].view(torch.float32),
                      temperature, top_k, top_p, pin)  # fmt: skip

    @classmethod
    def of(
        cls,
        seed_keys: Tensor,
        positions: Tensor,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        host_temperature: list[float],
        host_top_k: list[int],
        host_top_p: list[float],
        pin: bool = False,
    ) -> Rows:
        """Device tensors with the host's copy of their values, from which the flags are read (and the filtered
        rows' indices sent, as :meth:`build` sends)."""
        sampled = [t > 0 for t in host_temperature]
        rows = [i for i, s in enumerate(sampled) if s and (host_top_k[i] > 0 or host_top_p[i] < 1)]
        filtered = None
        if rows:
            filtered = to_device(torch.tensor(rows, dtype=torch.int64), seed_keys.device, pin)
        return cls(
            seed_keys,
            positions,
            temperature,
            top_k,
            top_p,
            sampled=any(sampled),
            greedy=not all(sampled),
            unit_temperature=all(t == 1 for t in host_temperature if t > 0),
            filtered=filtered,
            top_k_max=max((host_top_k[i] for i in rows), default=0),
            top_p_any=any(host_top_p[i] < 1 for i in rows),
        )


def filter_logits(
    scaled: Tensor, top_k: Tensor, top_p: Tensor, top_k_max: int | None = None, top_p_any: bool | None = None
) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k and then its nucleus (top-p) set. ``top_k_max`` and
    ``top_p_any``, where the caller knows them, spare reading the device; top-k takes the k-th value from a
    ``topk`` of the largest k asked for, only top-p sorts."""
    vocab = scaled.shape[-1]
    if top_k_max is None:
        top_k_max = int(top_k.max()) if top_k.numel() else 0
    if top_p_any is None:
        top_p_any = bool((top_p < 1).any())
    if top_k_max > 0:
        k = top_k.to(torch.int64).clamp(max=vocab)
        kk = min(top_k_max, vocab)
        kth = scaled.topk(kk, dim=-1).values.gather(-1, (k.clamp(min=1) - 1)[:, None])
        kth = torch.where(k[:, None] > 0, kth, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p_any:
        probs, order = scaled.softmax(-1).sort(dim=-1, descending=True, stable=True)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def draw(logits: Tensor, rows: Rows, scratch: Scratch | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row. Returns ``(tokens [B] int64, logprobs [B] float32)``, on the device, without
    reading it. ``scratch``: buffers to work in, kept by a caller that draws again (see :class:`Scratch`).

    The log-prob is that of the token under the temperature-scaled, unfiltered distribution - the one the
    trainer recomputes - so importance ratios start at 1 (greedy rows: temperature 1).
    """
    logits = logits.float()
    scaled = logits
    if not rows.unit_temperature:
        scaled = logits / torch.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    x, t = _buffers(scratch, *logits.shape, logits.device)
    if rows.sampled:
        race = gumbel_race(scaled, row_keys(rows.seed_keys, rows.positions), x, t)
        if rows.filtered is not None:
            sub = filter_logits(
                scaled.index_select(0, rows.filtered),
                rows.top_k.index_select(0, rows.filtered),
                rows.top_p.index_select(0, rows.filtered),
                rows.top_k_max,
                rows.top_p_any,
            )
            dropped = race.index_select(0, rows.filtered).masked_fill_(sub.isneginf(), float("-inf"))
            race.index_copy_(0, rows.filtered, dropped)
        tokens = race.argmax(-1)
        del race
        if rows.greedy:
            tokens = torch.where(rows.temperature > 0, tokens, logits.argmax(-1))
    else:
        tokens = logits.argmax(-1)
    logprobs = torch.log_softmax(scaled, dim=-1, out=t.view(torch.float32)).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`draw` for per-row tensors, which it reads once to know the flags (the engines build
    :class:`Rows` from host values instead). Returns ``(tokens [B], logprobs [B])``; ``temperature <= 0`` is
    greedy."""
    host = [x.tolist() for x in (seeds, positions, temperature, top_k, top_p)]
    return draw(logits, Rows.build(*host, device=logits.device))
