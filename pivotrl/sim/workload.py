"""What a simulated step has to do: how many responses, how long, judged by which model.

Response lengths drive everything a shiftable deployment exploits: a long tail
keeps a few rollout devices busy while the rest could judge or train. They come
from a parametric distribution or from a trace of a real run, always capped at
the generation limit (``max_new_tokens``) as the engine caps them.
"""

from __future__ import annotations

import enum
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

from pivotrl.sim.models import MODELS, ModelSpec


class LengthKind(enum.Enum):
    FIXED = "fixed"  # every response ``value`` tokens
    UNIFORM = "uniform"  # integers ``lo``..``hi``, each equally likely
    LOGNORMAL = "lognormal"  # ``median`` tokens, log-space spread ``sigma``: the bulk of typical responses
    PARETO = "pareto"  # at least ``minimum``, tail index ``alpha``: a heavy tail (lower alpha, heavier)
    TRACE = "trace"  # drawn from the ``lengths`` of a recorded run


_PARAMS: dict[LengthKind, tuple[str, ...]] = {
    LengthKind.FIXED: ("value",),
    LengthKind.UNIFORM: ("lo", "hi"),
    LengthKind.LOGNORMAL: ("median", "sigma"),
    LengthKind.PARETO: ("minimum", "alpha"),
    LengthKind.TRACE: ("lengths",),
}
_ALL_PARAMS = tuple(p for ps in _PARAMS.values() for p in ps)


_STANDARD_NORMAL = NormalDist()


def normal_score(u: float) -> float:
    """The standard normal quantile of ``u``, kept off the infinite ends of [0, 1)."""
    return _STANDARD_NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of response lengths in tokens, capped at ``cap``.

    Samples are whole tokens in ``[1, cap]``: a response has at least its stop token,
    and the engine stops every other one at ``cap``. Build one with the class methods
    (``LengthDist.lognormal(300, 0.8, cap=2048)``), ``from_dict`` or ``from_trace``.
    """

    kind: LengthKind  # or its name: "fixed", "uniform", "lognormal", "pareto", "trace"
    cap: int  # the generation limit, max_new_tokens
    value: int | None = None  # fixed: every length
    lo: int | None = None  # uniform: shortest
    hi: int | None = None  # uniform: longest (before the cap)
    median: float | None = None  # lognormal: the median length, exp(mu)
    sigma: float | None = None  # lognormal: standard deviation of log(length)
    minimum: float | None = None  # pareto: the scale, the shortest length
    alpha: float | None = None  # pareto: the tail index; P(L > x) = (minimum / x) ** alpha
    lengths: tuple[int, ...] | None = None  # trace: the recorded lengths, drawn with replacement

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LengthKind):
            try:
                object.__setattr__(self, "kind", LengthKind(self.kind))
            except ValueError:
                allowed = ", ".join(k.value for k in LengthKind)
                raise ValueError(f"kind: got {self.kind!r}, allowed: {allowed}") from None
        if not _is_int(self.cap) or self.cap < 1:
            raise ValueError(f"cap: got {self.cap!r}, must be an int >= 1")
        if isinstance(self.lengths, list):
            object.__setattr__(self, "lengths", tuple(self.lengths))
        wanted = _PARAMS[self.kind]
        for name in _ALL_PARAMS:
            given = getattr(self, name) is not None
            if given != (name in wanted):
                what = "is missing" if not given else "is not one of its parameters"
                raise ValueError(f"{self.kind.value} length distribution: {name} {what}; it takes {', '.join(wanted)}")
        self._check_params()

    def _check_params(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{self.kind.value}.{name}: got {getattr(self, name)!r}, must be {allowed}")

        for name in _PARAMS[self.kind]:
            v = getattr(self, name)
            if name in ("value", "lo", "hi") and (not _is_int(v) or v < 1):
                raise bad(name, "an int >= 1")
            if name in ("median", "minimum", "alpha") and (not _is_number(v) or not 0 < v < math.inf):
                raise bad(name, "a finite number > 0")
            if name == "sigma" and (not _is_number(v) or not 0 <= v < math.inf):
                raise bad(name, "a finite number >= 0")
        if self.kind is LengthKind.UNIFORM and self.lo > self.hi:
            raise bad("hi", f">= lo ({self.lo})")
        if self.kind is LengthKind.TRACE and (not self.lengths or not all(_is_int(n) and n >= 0 for n in self.lengths)):
            raise ValueError("trace.lengths: must be a non-empty tuple of ints >= 0")

    # -- constructors ------------------------------------------------------------------

    @classmethod
    def fixed(cls, value: int, cap: int | None = None) -> LengthDist:
        return cls(LengthKind.FIXED, value if cap is None else cap, value=value)

    @classmethod
    def uniform(cls, lo: int, hi: int, cap: int | None = None) -> LengthDist:
        return cls(LengthKind.UNIFORM, hi if cap is None else cap, lo=lo, hi=hi)

    @classmethod
    def lognormal(cls, median: float, sigma: float, cap: int) -> LengthDist:
        return cls(LengthKind.LOGNORMAL, cap, median=median, sigma=sigma)

    @classmethod
    def pareto(cls, minimum: float, alpha: float, cap: int) -> LengthDist:
        return cls(LengthKind.PARETO, cap, minimum=minimum, alpha=alpha)

    @classmethod
    def from_trace(cls, path: str | Path, cap: int | None = None) -> LengthDist:
        """Lengths recorded in a JSONL file: one per line, a bare int or an object with an int ``length``
        (other fields ignored); blank lines skipped. ``cap`` defaults to the longest recorded."""
        lengths: list[int] = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg}): {text[:80]}") from None
                n = obj.get("length") if isinstance(obj, dict) else obj
                if not _is_int(n) or n < 0:
                    raise ValueError(
                        f'{path}:{lineno}: expected an int >= 0 or {{"length": <int >= 0>, ...}}, got {text[:80]}'
                    )
                lengths.append(n)
        if not lengths:
            raise ValueError(f"{path}: no lengths in the trace")
        return cls(LengthKind.TRACE, max(max(lengths), 1) if cap is None else cap, lengths=tuple(lengths))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LengthDist:
        """``{"kind": "lognormal", "median": 300, "sigma": 0.8, "cap": 2048}``; a trace is
        ``{"kind": "trace", "path": "lengths.jsonl"}`` with an optional ``cap``."""
        if not isinstance(data, dict) or "kind" not in data:
            raise ValueError(f"length distribution: expected an object with a 'kind', got {data!r}")
        params = dict(data)
        kind = params.pop("kind")
        if kind == LengthKind.TRACE.value:
            unknown = set(params) - {"path", "cap"}
            if unknown or "path" not in params:
                raise ValueError(f"trace length distribution: takes path and an optional cap, got {sorted(data)}")
            return cls.from_trace(params["path"], params.get("cap"))
        if "cap" not in params:
            raise ValueError(f"{kind} length distribution: cap is missing")
        unknown = set(params) - {"cap", *_ALL_PARAMS} | ({"lengths"} & set(params))
        if unknown:
            raise ValueError(f"{kind} length distribution: unknown keys {sorted(unknown)}")
        return cls(kind, **params)

    # -- use ---------------------------------------------------------------------------

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths; the same ``rng`` state gives the same lengths."""
        cap, k = self.cap, self.kind
        if k is LengthKind.FIXED:
            return [min(self.value, cap)] * n
        if k is LengthKind.UNIFORM:
            return [min(rng.randint(self.lo, self.hi), cap) for _ in range(n)]
        if k is LengthKind.TRACE:
            return [max(1, min(x, cap)) for x in rng.choices(self.lengths, k=n)]
        if k is LengthKind.LOGNORMAL:
            mu = math.log(self.median)
            return [max(1, min(cap, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]
        # Pareto by inverse transform, in log space so that a tiny u cannot overflow past the cap
        log_cap = math.log(cap / self.minimum) if cap > self.minimum else 0.0
        out = []
        for _ in range(n):
            excess = -math.log(1.0 - rng.random()) / self.alpha  # log(x / minimum), exponential
            out.append(max(1, min(cap, round(self.minimum * math.exp(min(excess, log_cap + 1.0))))))
        return out

    def quantile(self, u: float) -> int:
        """The length at quantile ``u`` in [0, 1): a draw by inverse transform from a uniform the caller
        derives from a sequence's seed, so the sequence gets the same length wherever it runs."""
        if not 0 <= u < 1:
            raise ValueError(f"u: got {u!r}, must be in [0, 1)")
        cap, k = self.cap, self.kind
        if k is LengthKind.FIXED:
            return min(self.value, cap)
        if k is LengthKind.UNIFORM:
            return min(self.lo + math.floor(u * (self.hi - self.lo + 1)), self.hi, cap)
        if k is LengthKind.TRACE:
            return max(1, min(self.lengths[math.floor(u * len(self.lengths))], cap))
        if k is LengthKind.LOGNORMAL:
            z = normal_score(u)
            return max(1, min(cap, round(self.median * math.exp(min(self.sigma * z, math.log(cap) + 1.0)))))
        excess = -math.log(1.0 - u) / self.alpha  # Pareto: log(x / minimum) is exponential
        log_cap = math.log(cap / self.minimum) if cap > self.minimum else 0.0
        return max(1, min(cap, round(self.minimum * math.exp(min(excess, log_cap + 1.0)))))

    def mean(self) -> float:
        """Mean of the capped distribution, in closed form (whole-token rounding aside)."""
        cap, k = self.cap, self.kind
        if k is LengthKind.FIXED:
            return float(min(self.value, cap))
        if k is LengthKind.TRACE:
            return sum(max(1, min(x, cap)) for x in self.lengths) / len(self.lengths)
        if k is LengthKind.UNIFORM:
            lo, hi = self.lo, self.hi
            if cap >= hi:
                return (lo + hi) / 2
            if cap <= lo:
                return float(cap)
            below = (lo + cap - 1) * (cap - lo) / 2  # lo .. cap-1 as drawn; cap .. hi become cap
            return (below + cap * (hi - cap + 1)) / (hi - lo + 1)
        if k is LengthKind.LOGNORMAL:
            mu, s = math.log(self.median), self.sigma
            if s == 0:
                return float(min(self.median, cap))
            z = (math.log(cap) - mu) / s
            return math.exp(mu + s * s / 2) * _normal_cdf(z - s) + cap * (1 - _normal_cdf(z))
        xm, a = self.minimum, self.alpha  # Pareto: E[min(X, c)] = xm + integral of P(X > x) from xm to c
        if cap <= xm:
            return float(cap)
        if a == 1:
            return xm + xm * math.log(cap / xm)
        return xm + xm * ((cap / xm) ** (1 - a) - 1) / (1 - a)

    def describe(self) -> str:
        """``lognormal(median=300, sigma=0.8, cap=2048)``: the short form for logs and reports."""
        if self.kind is LengthKind.TRACE:
            return f"trace({len(self.lengths)} lengths, mean={self.mean():.0f}, cap={self.cap})"
        args = ", ".join(f"{p}={getattr(self, p):g}" for p in _PARAMS[self.kind])
        return f"{self.kind.value}({args}, cap={self.cap})"


def replay_table(path: str | Path) -> dict[tuple[int, int], int]:
    """(step, uid) -> length from the rows of a length trace that carry all three as ints (a run's
    samples.jsonl numbering; other rows are ignored here). Raises ValueError if none does."""
    table: dict[tuple[int, int], int] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # (``from_trace`` names the line)
            if isinstance(row, dict) and all(_is_int(row.get(k)) for k in ("step", "uid", "length")):
                table[(row["step"], row["uid"])] = row["length"]
    if not table:
        raise ValueError(f'{path}: no rows to replay (each needs int "step", "uid" and "length")')
    return table


def correlated(group: float, own: float, rho: float) -> float:
    """A draw's quantile in [0, 1) from a uniform shared by its group and its own: their normal scores
    mixed so that two draws of one group correlate ``rho`` on the normal scale (a Gaussian copula).
    Every draw keeps the distribution it is fed to; 0 gives ``own``, 1 gives ``group``."""
    if not 0 <= rho <= 1:
        raise ValueError(f"rho: got {rho!r}, must be in [0, 1]")
    if rho == 0:
        return own
    if rho == 1:
        return group
    z = math.sqrt(rho) * normal_score(group) + math.sqrt(1 - rho) * normal_score(own)
    return min(_normal_cdf(z), math.nextafter(1.0, 0.0))


def group_correlation(groups: list[list[int]]) -> float:
    """The correlation of lengths within groups, as ``correlated`` draws them: on the normal scores of
    their ranks (ties share a mid-rank), one minus the within-group variance over the total (both
    unbiased, so that lengths drawn alone give about 0), in [0, 1]. Groups of one say nothing and
    are left out; 0 when no two lengths differ."""
    groups = [g for g in groups if len(g) > 1]
    flat = sorted(x for g in groups for x in g)
    if not flat or flat[0] == flat[-1]:
        return 0.0
    first: dict[int, int] = {}
    for i, x in enumerate(flat):
        first.setdefault(x, i)
    last = {x: i for i, x in enumerate(flat)}
    n = len(flat)
    score = {x: _STANDARD_NORMAL.inv_cdf((first[x] + last[x] + 1) / 2 / n) for x in first}
    scores = [[score[x] for x in g] for g in groups]
    mean = sum(map(sum, scores)) / n
    total = sum((v - mean) ** 2 for g in scores for v in g) / (n - 1)
    within = sum(sum((v - sum(g) / len(g)) ** 2 for v in g) for g in scores) / (n - len(scores))
    return min(1.0, max(0.0, 1 - within / total)) if total > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SimWorkload:
    """The work of one simulated RL step; validated when built (``validate``)."""

    prompts_per_step: int  # prompts drawn per step
    group_size: int  # responses the policy generates per prompt (the GRPO group)
    prompt_len: int  # tokens of a policy prompt, chat template included
    response_len: LengthDist  # tokens of a policy response
    judge_template_len: int  # tokens the GenRM prompt adds to question and response (instructions, reference)
    judge_output_len: LengthDist | int  # tokens the GenRM writes per judgment: rationale and verdict
    policy: str  # name of the policy in ``MODELS``
    judge: str  # name of the judge in ``MODELS``

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is wrong, its value and what is allowed."""
        for name, least in (("prompts_per_step", 1), ("group_size", 1), ("prompt_len", 1), ("judge_template_len", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < least:
                raise ValueError(f"{name}: got {value!r}, must be an int >= {least}")
        if not isinstance(self.response_len, LengthDist):
            raise ValueError(f"response_len: got {self.response_len!r}, must be a LengthDist")
        out = self.judge_output_len
        if not isinstance(out, LengthDist) and (not _is_int(out) or out < 1):
            raise ValueError(f"judge_output_len: got {out!r}, must be a LengthDist or an int >= 1")
        for name in ("policy", "judge"):
            if getattr(self, name) not in MODELS:
                raise ValueError(f"{name}: got {getattr(self, name)!r}, known models: {', '.join(MODELS)}")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def judge_output_dist(self) -> LengthDist:
        out = self.judge_output_len
        return out if isinstance(out, LengthDist) else LengthDist.fixed(out)

    @property
    def policy_model(self) -> ModelSpec:
        return MODELS[self.policy]

    @property
    def judge_model(self) -> ModelSpec:
        return MODELS[self.judge]

    def judge_prompt_len(self, response_len: int) -> int:
        """Tokens the GenRM prefills for one judgment: the question, the response, its template."""
        return self.prompt_len + response_len + self.judge_template_len


GRID = 4096  # quantiles of the length distribution the expectations are taken over


def quantiles(dist: LengthDist, n: int, cap: int) -> list[int]:
    """``n`` evenly spaced quantiles of ``min(L, cap)``, shortest first: the lengths of ``n`` draws as a step
    of ``n`` responses spreads them, the grid every expectation and floor here is taken over."""
    return [min(dist.quantile((i + 0.5) / n), cap) for i in range(n)]


def length_moments(dist: LengthDist, cap: int, grid: int = GRID) -> tuple[float, float]:
    """``E[L]`` and ``E[L (L - 1) / 2]`` of ``min(L, cap)``, over ``grid`` evenly spaced quantiles."""
    if grid < 1:
        raise ValueError(f"grid: got {grid!r}, must be >= 1")
    lengths = quantiles(dist, grid, cap)
    return sum(lengths) / grid, sum(n * (n - 1) / 2 for n in lengths) / grid


def decode_context(prompt: int, dist: LengthDist, cap: int, grid: int = GRID) -> float:
    """The mean context of a decode step of responses of ``dist`` after ``prompt`` tokens: a response
    decodes L - 1 steps at contexts prompt + 1 .. prompt + L - 1, so steps weigh by length."""
    mean, pairs = length_moments(dist, cap, grid)
    return prompt + pairs / (mean - 1) if mean > 1 else float(prompt)
