"""What the planner knows: live measurements and what is left of the step.

* ``LengthModel``: response lengths seen, for how long running sequences still
  go (their expected rest, and the expected end of the last of them);
* ``RoleProfile``: how fast a device generates against its batch; ``TrainProfile``:
  how fast it trains;
* ``ShiftCosts``: the measured seconds of each kind of shift;
* ``Workload``: the step's remaining work, as the controller sees it.

All pure Python, learned online from the events of a run (or given by the
simulator's cost model).
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from pivotrl.control.messages import Role


def _positive(name: str, value: float, strict: bool = True) -> None:
    bad = value <= 0 if strict else value < 0
    if bad or math.isnan(value):
        allowed = "> 0" if strict else ">= 0"
        raise ValueError(f"{name}: got {value!r}, must be {allowed}")


@dataclass(slots=True)
class LengthModel:
    """Response lengths of finished sequences, for the expected rest of running ones.

    The tail of a rollout is a few long sequences; how long they still run is
    the expected excess ``E[L - t | L > t]`` of the length distribution past
    what each has already generated. The distribution is the empirical one of
    the last ``window`` responses, so it follows the policy as its lengths drift.
    """

    prior_mean: float = 256.0  # mean response length assumed before ``min_samples`` are seen
    prior_max: float = 1024.0  # no response runs longer (the generation limit)
    min_samples: int = 32
    window: int = 4096
    floor: float = 1.0  # tokens still expected from a sequence that outlived every observed one
    _recent: deque[int] = field(default_factory=deque, init=False, repr=False)
    _sorted: list[int] = field(default_factory=list, init=False, repr=False)
    _suffix: list[float] | None = field(default=None, init=False, repr=False)  # sums of _sorted[i:], lazily

    def __post_init__(self) -> None:
        _positive("prior_mean", self.prior_mean)
        _positive("prior_max", self.prior_max)
        _positive("floor", self.floor)
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(f"min_samples={self.min_samples}, window={self.window}: need 1 <= min_samples <= window")

    @property
    def samples(self) -> int:
        return len(self._sorted)

    @property
    def mean(self) -> float:
        if self.samples < self.min_samples:
            return self.prior_mean
        return self._sums()[0] / self.samples

    def observe(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"length: got {length}, must be >= 0")
        self._recent.append(length)
        insort(self._sorted, length)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect_right(self._sorted, old) - 1]
        self._suffix = None

    def expected_remaining(self, tokens_so_far: float) -> float:
        """``E[L - t | L > t]``, at least ``floor``.

        Before ``min_samples`` responses the prior is memoryless (exponential
        lengths of mean ``prior_mean``): having run long says nothing yet about
        how much is left; only the generation limit ``prior_max`` bounds it.
        Past every observed length the data say nothing either; ``floor`` keeps
        such a sequence counted as unfinished work without inventing a tail.
        """
        t = tokens_so_far
        if self.samples < self.min_samples:
            return min(self.prior_mean, max(self.prior_max - t, self.floor))
        i = bisect_right(self._sorted, t)
        longer = self.samples - i
        if longer == 0:
            return self.floor
        return max(self.floor, self._sums()[i] / longer - t)

    def expected_longest(self, running: dict[int, int], grid: int = 32) -> float:
        """Expected tokens until the last of the running sequences ends, for ``running``
        (tokens so far -> how many sequences): ``E[max_i (L_i - t_i) | L_i > t_i]``.

        This, not the largest expected rest, is when a rollout ends: of a hundred
        sequences each expected to need 15 more tokens, one likely needs 50. The
        sequences are independent draws from the observed lengths; ``E[max] = integral
        of 1 - F(x)`` is summed on ``grid`` points. Before ``min_samples`` responses it
        is the largest expected rest (the prior says nothing about the spread).
        """
        if self.samples < self.min_samples or not running:
            return max((self.expected_remaining(t) for t in running), default=0.0)
        s, n = self._sorted, self.samples
        groups = [(t, k, n - bisect_right(s, t)) for t, k in running.items()]
        live = [(t, k, above) for t, k, above in groups if above]
        if not live:
            return self.floor
        top = s[-1] - min(t for t, _, _ in live)
        step, total = top / grid, 0.0
        for j in range(grid):
            x = (j + 0.5) * step
            f = 1.0
            for t, k, above in live:
                f *= ((bisect_right(s, t + x) - (n - above)) / above) ** k  # P(L <= t + x | L > t)
            total += (1.0 - f) * step
        return max(total, self.floor)

    def done_by(self, tokens_so_far: float, xs: list[float]) -> list[float]:
        """``P(L <= t + x | L > t)`` at each ``x`` of ``xs``: the chance a sequence that has
        generated ``t`` tokens has ended within ``x`` more (memoryless before ``min_samples``;
        past every observed length it ends at once)."""
        t = tokens_so_far
        if self.samples < self.min_samples:
            left = max(self.prior_max - t, self.floor)
            return [1.0 if x >= left else 1.0 - math.exp(-x / self.prior_mean) for x in xs]
        s, n = self._sorted, self.samples
        below = bisect_right(s, t)
        above = n - below
        if above == 0:
            return [1.0] * len(xs)
        return [(bisect_right(s, t + x) - below) / above for x in xs]

    def max_remaining(self, tokens_so_far: float) -> float:
        """The most a sequence may still generate: up to the longest observed
        response (``prior_max`` before ``min_samples``), at least ``floor``."""
        longest = self.prior_max if self.samples < self.min_samples else self._sorted[-1]
        return max(longest - tokens_so_far, self.floor)

    def _sums(self) -> list[float]:
        if self._suffix is None:
            acc, out = 0.0, [0.0] * (self.samples + 1)
            for i in range(self.samples - 1, -1, -1):
                acc += self._sorted[i]
                out[i] = acc
            self._suffix = out
        return self._suffix


@dataclass(slots=True)
class RoleProfile:
    """How fast one device generates in a role, against its batch and their context, learned online.

    A decode step of ``b`` sequences whose contexts average ``c`` tokens takes about
    ``step_base + step_per_seq * b + step_per_kv * b * c`` seconds: what every step
    pays whatever its batch (reading the weights, launching kernels, the host loop),
    each sequence's own share (its FLOPs, its sampling) and the KV cache it reads,
    one token of it per token of context. So a device makes ``rate(b, c) = b /
    step_seconds(b, c)`` tokens/s: a sequence alone goes at ``rate(1, c)``, and a
    device gains throughput with every sequence it batches, ever more slowly. (A
    min(b * per-sequence rate, device rate) roofline says a device saturates; on a
    GPU whose step is dominated by reading KV caches it never does, and a planner
    that believes it does crams the rollout onto too few devices.)

    The context term is the rollout's own clock: a decode step reads its
    sequences' whole contexts, which grow token by token over the rollout, so the
    same batch that is cheap at a step's start is dear in its tail. A line in the batch
    alone, fitted to the whole step's slices, prices every step at their mix: big
    early batches look dearer than they are, the long tail cheaper.

    Each measured slice (tokens in seconds at batch b, mean context c) is a point
    ``(b, b * c, seconds * b / tokens)``. The plane is a least-squares fit in which
    every slice weighs ``decay`` times the one after it, and the prior counts as
    two points of weight ``prior_weight`` (batch 1 and ``ref_batch`` at the prior
    context) and a pull of the same weight on the context term: it decides alone
    before the first slice, and where the slices say nothing (slices that all ran
    at one batch and context fix the plane's height there, not its tilts). A slice
    that names no context is taken at ``context``, the decaying mean of those that did.

    Real steps are not a plane. A mixture-of-experts model reads more experts as
    its batch grows, ever fewer new ones, so its step rises steeply over the first
    sequences and then flattens. So the slices are also kept per batch bin (powers
    of two, each bin's mean decaying as its own slices come): ``step_seconds`` is
    the plane times the measured-to-plane ratio of the bins, interpolated in log
    batch between them and held beyond the outer ones. A bin keeps its mean while
    other batches are measured: the tail's small batches are remembered from one
    step's tail to the next.
    """

    step_base: float  # seconds of a decode step whatever its batch (the fitted plane's)
    step_per_seq: float  # seconds each sequence adds to a step (the fitted plane's)
    step_per_kv: float = 0.0  # seconds each token of a sequence's context adds to a step (its KV cache read)
    context: float = 0.0  # mean context (tokens) of a step where a caller names none: the prior's, then measured
    prefill_rate: float = 5000.0  # tokens/s a device reads prompts at (EWMA of timed prefills)
    decay: float = 0.99  # weight an older slice keeps at each new one (in the plane; in its bin)
    prior_weight: float = 0.1
    ref_batch: float = 32.0
    samples: int = 0
    # weighted sums of the fit over the points (1, b, u = b * c; y): w, wb, wu, wbb, wbu, wuu, wy, wby, wuy, wyy
    _data: list[float] = field(default_factory=lambda: [0.0] * 10, init=False, repr=False)
    _prior: tuple[float, ...] = field(default=(), init=False, repr=False)
    _ctx: list[float] = field(default_factory=lambda: [0.0, 0.0], init=False, repr=False)  # decayed sums of b, b * c
    _bins: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)  # log2 bin -> [w, wb, wu, wy]
    _curve: tuple[list[float], list[float]] = field(default=([], []), init=False, repr=False)  # log2 b, ratio
    _stale: bool = field(default=False, init=False, repr=False)  # the bins changed since ``_curve`` was drawn

    def __post_init__(self) -> None:
        _positive("step_base", self.step_base)
        _positive("step_per_seq", self.step_per_seq, strict=False)
        _positive("step_per_kv", self.step_per_kv, strict=False)
        _positive("context", self.context, strict=False)
        _positive("prior_weight", self.prior_weight)
        _positive("ref_batch", self.ref_batch)
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay: got {self.decay!r}, must be in (0, 1]")
        if self.ref_batch <= 1:
            raise ValueError(f"ref_batch: got {self.ref_batch!r}, must be > 1 (the prior's second point)")
        sums = [0.0] * 10
        c = self.context
        for b in (1.0, self.ref_batch):
            _add(sums, b, b * c, self.plane(b, b * c), self.prior_weight)
        # and the context term held near the prior's: a deviation that moves the step at ``ref_batch``
        # by its own length (at the prior context, or PRIOR_CONTEXT_SPAN tokens if longer) weighs as a
        # prior point. Without it, slices all at one context would tilt the plane at will in a
        # direction they say nothing about
        kv = self.ref_batch * max(c, PRIOR_CONTEXT_SPAN)
        ridge = self.prior_weight * (kv / self.plane(self.ref_batch, self.ref_batch * c)) ** 2
        sums[5] += ridge
        sums[8] += ridge * self.step_per_kv
        sums[9] += ridge * self.step_per_kv**2
        self._prior = tuple(sums)

    @classmethod
    def from_rates(cls, seq_rate: float, device_rate: float, **kwargs: float) -> RoleProfile:
        """The line through ``rate(1) = seq_rate`` approaching ``device_rate`` with large batches
        (no context term: rates measured at one context)."""
        _positive("seq_rate", seq_rate)
        _positive("device_rate", device_rate)
        if device_rate <= seq_rate:
            raise ValueError(f"device_rate: got {device_rate}, must exceed seq_rate {seq_rate}")
        return cls(step_base=1 / seq_rate - 1 / device_rate, step_per_seq=1 / device_rate, **kwargs)

    def observe(self, tokens: int, seconds: float, batch: float, context: float | None = None) -> None:
        """One measured slice: ``tokens`` sampled in ``seconds`` by ``batch`` sequences (a mean) whose
        contexts averaged ``context`` tokens (None: not measured, taken at ``self.context``).
        A slice without tokens (prefill only) says nothing about decoding and is skipped."""
        _positive("seconds", seconds)
        if tokens < 0 or batch < 1:
            raise ValueError(f"tokens={tokens}, batch={batch}: need tokens >= 0 and batch >= 1")
        if context is not None and not 0 <= context < math.inf:
            raise ValueError(f"context: got {context!r}, must be a finite number >= 0")
        if tokens == 0:
            return
        decay, d = self.decay, self._data  # (every slice of a run comes here: 10^5 at cluster scale)
        if context is not None:
            cs = self._ctx
            cs[0], cs[1] = cs[0] * decay + batch, cs[1] * decay + batch * context
            self.context = cs[1] / cs[0]
        c = self.context if context is None else context
        d[:] = [x * decay for x in d]
        b, u = float(batch), batch * c
        y = seconds * batch / tokens  # a step's seconds: seconds / (tokens / batch)
        _add(d, b, u, y, 1.0, max(y, self.plane(b, u)))
        sums = self._bins.setdefault(int(math.log2(batch)), [0.0, 0.0, 0.0, 0.0])
        sums[0], sums[1] = sums[0] * decay + 1.0, sums[1] * decay + b
        sums[2], sums[3] = sums[2] * decay + u, sums[3] * decay + y
        self.samples += 1
        self._fit()

    def observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.3) -> None:
        """A timed prefill (``tokens`` in ``seconds``) moves ``prefill_rate`` towards it."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate += alpha * (tokens / seconds - self.prefill_rate)

    def _fit(self) -> None:
        s = [p + x for p, x in zip(self._prior, self._data, strict=True)]
        base, per_seq, per_kv = nonneg_fit([[s[j] for j in row] for row in _GRAM], [s[i] for i in _MOMENT], s[9])
        if base <= 0:  # the data say a step costs nothing of its own: all of it is per sequence
            base, per_seq, per_kv = 1e-9, max(per_seq, 1e-9), max(per_kv, 1e-9)
        self.step_base, self.step_per_seq, self.step_per_kv = base, per_seq, per_kv
        self._stale = True  # the curve is drawn when next asked for: slices come far more often than plans

    def _draw(self) -> tuple[list[float], list[float]]:
        if self._stale:
            xs, ratios = [], []
            for _, (w, wb, wu, wy) in sorted(self._bins.items()):
                xs.append(math.log2(wb / w))
                ratios.append(wy / w / self.plane(wb / w, wu / w))
            self._curve, self._stale = (xs, ratios), False
        return self._curve

    def plane(self, batch: float, kv: float) -> float:
        """The fitted plane's step seconds at ``batch`` sequences holding ``kv`` tokens of context in all."""
        return self.step_base + self.step_per_seq * batch + self.step_per_kv * kv

    def line(self, batch: float, context: float | None = None) -> float:
        """The fitted plane's step seconds at ``batch`` and ``context`` (``step_seconds`` without the
        bins' shape)."""
        return self.plane(batch, batch * (self.context if context is None else context))

    def step_seconds(self, batch: float, context: float | None = None) -> float:
        """Seconds of a decode step of ``batch`` sequences of ``context`` tokens each (None: ``self.context``)."""
        xs, ratios = self._draw()
        if not xs:
            return self.line(batch, context)
        x = math.log2(max(batch, 1.0))
        i = bisect_right(xs, x)
        if i == 0:
            ratio = ratios[0]
        elif i == len(xs):
            ratio = ratios[-1]
        else:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            ratio = ratios[i - 1] + f * (ratios[i] - ratios[i - 1])
        return self.line(batch, context) * ratio

    def rate(self, batch: float, context: float | None = None) -> float:
        """Tokens/s of one device running ``batch`` sequences (fractional in the fluid model) of
        ``context`` tokens each."""
        return batch / self.step_seconds(batch, context) if batch > 0 else 0.0


PRIOR_CONTEXT_SPAN = 256.0  # tokens of context at least over which the prior holds its context term


def _add(sums: list[float], b: float, u: float, y: float, w: float, scale: float | None = None) -> None:
    """Point ``(1, b, u; y)`` into the sums of a least-squares plane, weighed ``w / scale^2``
    (``scale`` defaults to ``y``): errors count relative to the step they are of, so a prior off by
    orders of magnitude gives way to the data, and a slice measuring next to nothing cannot outweigh all."""
    scale = y if scale is None else scale
    w /= scale * scale
    wb, wu, wy = w * b, w * u, w * y
    sums[0] += w
    sums[1] += wb
    sums[2] += wu
    sums[3] += wb * b
    sums[4] += wb * u
    sums[5] += wu * u
    sums[6] += wy
    sums[7] += wb * y
    sums[8] += wu * y
    sums[9] += wy * y


_GRAM = ((0, 1, 2), (1, 3, 4), (2, 4, 5))  # index of sum(w x_i x_j) in ``_add``'s sums
_MOMENT = (6, 7, 8)  # index of sum(w x_i y)


def nonneg_fit(gram: list[list[float]], moment: list[float], yy: float) -> list[float]:
    """Weighted least squares with every coefficient >= 0, from its normal equations: ``gram`` is
    sum(w x x^T), ``moment`` sum(w x y), ``yy`` sum(w y^2). The unconstrained fit where none of its
    coefficients is negative (no subset fits better), else the best fit over the subsets of the
    columns whose coefficients all are >= 0 (zeros if none is). A term the data cannot tell apart
    from the others drops out at 0 rather than going negative, making steps cost less than nothing."""
    k = len(moment)
    full = solve_linear(gram, moment)
    if full is not None and min(full) >= 0:
        return full
    best: tuple[float, list[float]] = (math.inf, [0.0] * k)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        x = solve_linear([[gram[i][j] for j in cols] for i in cols], [moment[i] for i in cols])
        if x is None or min(x) < 0:
            continue
        coef = [0.0] * k
        for j, v in zip(cols, x, strict=True):
            coef[j] = v
        # sum(w (y - x.coef)^2), from the sums
        sse = (
            yy
            - 2 * sum(c * m for c, m in zip(coef, moment, strict=True))
            + sum(coef[i] * coef[j] * gram[i][j] for i in cols for j in cols)
        )
        if sse < best[0]:
            best = (sse, coef)
    return best[1]


def solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None if ``a`` is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


@dataclass(slots=True)
class TrainProfile:
    """Training throughput of one device (tokens/s through forward and backward), learned
    online as an EWMA of measured backward passes: its cost is per token whatever the batch."""

    device_rate: float
    alpha: float = 0.3  # weight of a new measurement
    samples: int = 0

    def __post_init__(self) -> None:
        _positive("device_rate", self.device_rate)
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha: got {self.alpha!r}, must be in (0, 1]")

    def observe(self, tokens: int, seconds: float) -> None:
        _positive("seconds", seconds)
        if tokens < 0:
            raise ValueError(f"tokens: got {tokens}, must be >= 0")
        if tokens:
            self.device_rate += self.alpha * (tokens / seconds - self.device_rate)
            self.samples += 1


@dataclass(slots=True)
class ShiftCosts:
    """Measured seconds of a shift per (from role, to role); ``from`` None is a device's
    first load. (A migration's re-prefill is priced by its role's ``RoleProfile.prefill_rate``.)"""

    prior: float = 0.05  # seconds of a shift never measured
    _seen: dict[tuple[Role | None, Role], tuple[float, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive("prior", self.prior, strict=False)

    def observe(self, src: Role | None, dst: Role, seconds: float) -> None:
        _positive("seconds", seconds, strict=False)
        total, n = self._seen.get((src, dst), (0.0, 0))
        self._seen[(src, dst)] = (total + seconds, n + 1)

    def cost(self, src: Role | None, dst: Role) -> float:
        if src is dst:
            return 0.0
        total, n = self._seen.get((src, dst), (0.0, 0))
        return total / n if n else self.prior


@dataclass(slots=True)
class Profiles:
    NAMES: ClassVar[tuple[str, ...]] = ("rollout", "judge", "train", "lengths", "costs", "judgments")

    rollout: RoleProfile
    judge: RoleProfile
    train: TrainProfile
    lengths: LengthModel = field(default_factory=LengthModel)
    costs: ShiftCosts = field(default_factory=ShiftCosts)
    # verdict lengths of finished judgments: a judge that reasons writes some many times longer than the
    # mean, and the longest of those left, not their mean, is how long the judge runs past the rollout
    judgments: LengthModel = field(default_factory=LengthModel)

    def state(self) -> dict[str, Any]:
        """Everything learned, as plain JSON values (a checkpoint keeps it: a resumed run plans as the
        uninterrupted one would)."""
        return {name: _encode_fields(getattr(self, name)) for name in self.NAMES}

    def restore(self, state: dict[str, Any]) -> None:
        """Take up what :meth:`state` wrote."""
        for name, fields_ in state.items():
            _decode_fields(getattr(self, name), fields_)


def _role_pair(key: tuple[Role | None, Role]) -> str:
    return f"{key[0].value if key[0] else ''}>{key[1].value}"


def _encode(value: Any) -> Any:
    if isinstance(value, dict):
        return [[_role_pair(k) if isinstance(k, tuple) else k, _encode(v)] for k, v in value.items()]
    if isinstance(value, tuple | list | deque):
        return [_encode(v) for v in value]
    return value


def _encode_fields(obj: Any) -> dict[str, Any]:
    return {f.name: _encode(getattr(obj, f.name)) for f in fields(obj)}


OLD_ROLE_NAMES = {"genrm": "judge"}  # the judge's role in checkpoints written before it was renamed


def _decode_like(template: Any, value: Any) -> Any:
    """``value`` (JSON) in the shape of ``template``, the attribute it replaces."""
    if isinstance(template, dict):
        out = {}
        for k, v in value:
            if isinstance(k, str) and ">" in k:  # a (from role, to role) pair
                a, b = (OLD_ROLE_NAMES.get(r, r) for r in k.split(">"))
                k = (Role(a) if a else None, Role(b))
            out[k] = tuple(v) if isinstance(k, tuple) else v  # (shift costs are (total, count) pairs)
        return out
    if isinstance(template, deque):
        return deque(value)
    if isinstance(template, tuple):
        return tuple(value)
    return value


def _decode_fields(obj: Any, state: dict[str, Any]) -> None:
    for f in fields(obj):
        if f.name in state:
            setattr(obj, f.name, _decode_like(getattr(obj, f.name), state[f.name]))


@dataclass(slots=True)
class Workload:
    """What is left of the step, as the controller sees it now."""

    rollout_remaining: list[int] = field(default_factory=list)  # tokens so far per unfinished sequence (queued: 0)
    rollout_groups: list[int] = field(default_factory=list)  # the group of each (parallel; -1: none, empty: unknown)
    rollout_queued: int = 0  # of which waiting for a device
    rollout_holders: int = 0  # devices running the others (0: unknown, any rollout device may)
    judge_queued: int = 0  # judgments waiting or running
    judge_running: int = 0  # of which in flight on a judge device (they finish there)
    judge_holders: int = 0  # judge devices running those (0: unknown, any judge device may take them)
    judge_future: int = 0  # responses that will still need judging (= unfinished rollout sequences)
    judge_tokens_mean: float = 64.0  # tokens a judgment writes
    train_groups_left: int = 0  # groups whose backward is not done
    train_groups_ready: int = 0  # of which judged, so their backward can start now
    train_groups_judging: int = 0  # of which generated whole, waiting for judgments
    # tokens through the backward per group left: its responses as generated, those still generating at
    # their prompt and what they have so far (the planner adds what its length model expects them still to write)
    train_tokens_per_group: float = 512.0
    train_group_size: int = 1  # samples per group: the backward of one runs on up to this many devices
    step_seconds: float = 0.0  # the optimizer step, after the last backward
    prompt_tokens_mean: float = 0.0  # prompt tokens re-prefilled with a migrated sequence
    judge_read_tokens: float = 0.0  # prompt + response tokens the judgments queued or running have still to read
    # (a running judgment that has started writing has read its)
    judge_read_running: float = 0.0  # of which the running ones' (those not started yet)
    # verdict tokens the running judgments are expected still to write, given what each has written (None:
    # a whole judgment each, ``judge_tokens_mean``)
    judge_left_running: float | None = None
    judge_written: list[int] = field(default_factory=list)  # verdict tokens so far per running judgment (or none)
    # tokens a judge device reads per token of those prompts and responses (its template, and judgments a
    # full paged cache preempted, read again): measured over the last step
    judge_reread: float = 1.0
    lockstep_train: bool = False  # every group's backward runs at the step, once all are judged (FSDP2)
    train_devices_needed: int = 0  # the fewest train devices the step's optimizer step runs on (0: none to run)

    def __post_init__(self) -> None:
        for name in ("rollout_remaining", "judge_written"):
            if any(t < 0 for t in getattr(self, name)):
                raise ValueError(f"{name}: got {min(getattr(self, name))}, tokens must be >= 0")
        counts = ("rollout_queued", "rollout_holders", "judge_queued", "judge_running", "judge_holders",
                  "judge_future", "train_groups_left", "train_groups_ready", "train_groups_judging",
                  "train_devices_needed", "step_seconds", "prompt_tokens_mean", "judge_read_tokens",
                  "judge_read_running")  # fmt: skip
        for name in counts:
            _positive(name, getattr(self, name), strict=False)
        if self.rollout_groups and len(self.rollout_groups) != len(self.rollout_remaining):
            raise ValueError(
                f"rollout_groups: {len(self.rollout_groups)} entries for {len(self.rollout_remaining)} sequences"
                " (one group per unfinished sequence, or none)"
            )
        if self.judge_running > self.judge_queued or self.judge_read_running > self.judge_read_tokens:
            raise ValueError(
                f"judge_running={self.judge_running}, judge_read_running={self.judge_read_running}: the running"
                f" judgments are some of the {self.judge_queued} queued or running ({self.judge_read_tokens} tokens)"
            )
        _positive("judge_tokens_mean", self.judge_tokens_mean)
        _positive("judge_reread", self.judge_reread)
        if self.judge_left_running is not None:
            _positive("judge_left_running", self.judge_left_running, strict=False)
        _positive("train_tokens_per_group", self.train_tokens_per_group, strict=False)
        size = self.train_group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"train_group_size: got {self.train_group_size!r}, must be an integer >= 1")
