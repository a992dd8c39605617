"""What the planner knows: live measurements and what is left of the step.

* ``LengthModel``: response lengths seen, for how long running sequences still
  go (their expected rest, and the expected end of the last of them);
* ``RoleProfile``: throughput of a device in a role against its batch;
* ``ShiftCosts``: the measured seconds of each kind of shift, and the
  re-prefill rate that prices a migration;
* ``Workload``: the step's remaining work, as the controller sees it.

All pure Python, learned online from the events of a run (or given by the
simulator's cost model).
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field

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
    """Throughput of one device in a role, learned online: a roofline.

    ``rate(b) = min(b * seq_rate, device_rate)``: each sequence decodes at
    ``seq_rate`` until the device saturates at ``device_rate``. A measurement
    updates (EWMA) the term that binds at its batch, because that is the one it
    tells about: a tail slice of two sequences says how fast a sequence goes,
    not how much a full device does. A measurement beyond the other term raises
    it too. Priors come from the config or the simulator's cost model.
    """

    device_rate: float  # tokens/s of one device at saturation
    seq_rate: float  # tokens/s of one sequence (decode speed; for train: of one sample)
    alpha: float = 0.3  # weight of a new measurement
    samples: int = 0

    def __post_init__(self) -> None:
        _positive("device_rate", self.device_rate)
        _positive("seq_rate", self.seq_rate)
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha: got {self.alpha!r}, must be in (0, 1]")

    def observe(self, tokens: int, seconds: float, batch: int) -> None:
        """One measured slice: ``tokens`` produced in ``seconds`` by ``batch`` sequences.
        A slice without tokens (prefill only) says nothing about decoding and is skipped."""
        _positive("seconds", seconds)
        if tokens < 0 or batch < 1:
            raise ValueError(f"tokens={tokens}, batch={batch}: need tokens >= 0 and batch >= 1")
        if tokens == 0:
            return
        rate, a = tokens / seconds, self.alpha
        saturated = batch * self.seq_rate >= self.device_rate
        if saturated or rate > self.device_rate:
            self.device_rate += a * (rate - self.device_rate)
        if not saturated or rate / batch > self.seq_rate:
            self.seq_rate += a * (rate / batch - self.seq_rate)
        self.samples += 1

    def rate(self, batch: float) -> float:
        """Tokens/s of one device running ``batch`` sequences (fractional in the fluid model)."""
        return min(batch * self.seq_rate, self.device_rate) if batch > 0 else 0.0


@dataclass(slots=True)
class ShiftCosts:
    """Measured seconds of a shift per (from role, to role), and the cost of re-prefilling
    migrated sequences. ``from`` None is a device's first load."""

    prior: float = 0.05  # seconds of a shift never measured
    prefill_rate: float = 5000.0  # tokens/s a device re-prefills when a sequence migrates to it (learned)
    _seen: dict[tuple[Role | None, Role], tuple[float, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _positive("prior", self.prior, strict=False)
        _positive("prefill_rate", self.prefill_rate)

    def observe(self, src: Role | None, dst: Role, seconds: float) -> None:
        _positive("seconds", seconds, strict=False)
        total, n = self._seen.get((src, dst), (0.0, 0))
        self._seen[(src, dst)] = (total + seconds, n + 1)

    def cost(self, src: Role | None, dst: Role) -> float:
        if src is dst:
            return 0.0
        total, n = self._seen.get((src, dst), (0.0, 0))
        return total / n if n else self.prior

    def observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.3) -> None:
        """A measured prefill (tokens in seconds) moves ``prefill_rate`` towards it (EWMA)."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate += alpha * (tokens / seconds - self.prefill_rate)

    def migration_cost(self, tokens: float) -> float:
        return tokens / self.prefill_rate


@dataclass(slots=True)
class Profiles:
    rollout: RoleProfile
    judge: RoleProfile
    train: RoleProfile
    lengths: LengthModel = field(default_factory=LengthModel)
    costs: ShiftCosts = field(default_factory=ShiftCosts)


@dataclass(slots=True)
class Workload:
    """What is left of the step, as the controller sees it now."""

    rollout_remaining: list[int] = field(default_factory=list)  # tokens so far per unfinished sequence (queued: 0)
    judge_queued: int = 0  # judgments waiting or running
    judge_future: int = 0  # responses that will still need judging (= unfinished rollout sequences)
    judge_tokens_mean: float = 64.0  # tokens a judgment writes
    train_groups_left: int = 0  # groups whose backward is not done
    train_tokens_per_group: float = 512.0
    step_seconds: float = 0.0  # the optimizer step, after the last backward
    prompt_tokens_mean: float = 0.0  # prompt tokens re-prefilled with a migrated sequence

    def __post_init__(self) -> None:
        if any(t < 0 for t in self.rollout_remaining):
            raise ValueError(f"rollout_remaining: got {min(self.rollout_remaining)}, tokens must be >= 0")
        for name in ("judge_queued", "judge_future", "train_groups_left", "step_seconds", "prompt_tokens_mean"):
            _positive(name, getattr(self, name), strict=False)
        _positive("judge_tokens_mean", self.judge_tokens_mean)
        _positive("train_tokens_per_group", self.train_tokens_per_group)
