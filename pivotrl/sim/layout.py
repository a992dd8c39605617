"""How an instance runs its role: one engine over all its GPUs, or several smaller ones.

An instance of ``tp`` GPUs (one control-plane device) may run a role as
``tp // engine_tp`` engines of ``engine_tp`` GPUs each. Small engines get more
tokens out of a batch of many sequences (no collectives, each GPU reads its own
weights); a large one decodes each token sooner, and a 32B judge may not fit on
fewer GPUs. The instance's sequences are spread evenly over its engines (its
scheduler puts each new one on the least loaded), so a decode step of ``b``
sequences is a step of ``ceil(b / engines)`` on each, all in parallel.

``EngineLayout`` prices an instance's operations that way on any ``CostModel``
of single engines, and is a ``CostModel`` itself: the driver's engines, the
planner's start-up profile and the ideal ask it what they ask one engine.

``elastic`` is a bound, not a mechanism: every decode span runs on the layout
that makes it shortest (engines of ``engine_tp``, ``2 engine_tp``, ... GPUs
that fit the model and the batch's KV cache), changed for free, as if engines
merged and split with no weight reload, no KV move, no pause. It says how much
elastic tensor parallelism inside an instance could give at most.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pivotrl.control.messages import Role
from pivotrl.sim.costs import CostModel, Span, span_of
from pivotrl.sim.models import ModelSpec


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """``base`` costs of one engine, for an instance of ``tp`` GPUs running ``tp // engine_tp`` of them."""

    base: CostModel
    tp: int  # GPUs of the instance
    engine_tp: int  # GPUs of each engine (of the smallest, when elastic)
    elastic: bool = False
    slots: int = 0  # sequences one engine runs at most (elastic: a layout must hold the batch); 0: no limit
    # (what, id(model)) -> (model, its layouts or its span): asked for at every prefill and span of an engine
    _kept: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, least in (("tp", 1), ("engine_tp", 1), ("slots", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: got {value!r}, must be an int >= {least}")
        if self.tp % self.engine_tp:
            raise ValueError(f"engine_tp: got {self.engine_tp}, must divide the instance's {self.tp} GPUs")

    @property
    def engines(self) -> int:
        """Engines of the instance in its smallest layout (the one it loads, and the most it runs)."""
        return self.tp // self.engine_tp

    def _keep(self, what: str, model: ModelSpec, make: Callable[[], Any]) -> Any:
        """``make()`` for ``model``, made once (keyed by its identity, checked: a model freed and another made
        at its address must not find the old one's)."""
        hit = self._kept.get((what, id(model)))
        if hit is not None and hit[0] is model:
            return hit[1]
        value = make()
        self._kept[(what, id(model))] = (model, value)
        return value

    def layouts(self, model: ModelSpec) -> list[tuple[int, int, int | None]]:
        """(GPUs per engine, engines, KV tokens per engine) of each layout the span may take, smallest
        engines first: the fixed one, or (elastic) every doubling that divides the instance and holds the
        model."""
        return self._keep("layouts", model, lambda: self._layouts(model))

    def _layouts(self, model: ModelSpec) -> list[tuple[int, int, int | None]]:
        out = []
        g = self.engine_tp
        while g <= self.tp:
            if self.tp % g == 0:
                kv = self.base.kv_tokens(model, g)
                if g == self.engine_tp or kv is None or kv > 0:
                    out.append((g, self.tp // g, kv))
            if not self.elastic:
                break
            g *= 2
        return out

    def span_of(self, model: ModelSpec, tp: int) -> Span:
        """The instance's ``decode_span``: each engine's share of the batch, in parallel; or (elastic) the
        shortest over the layouts whose engines hold their share (``slots``, and their KV cache at the
        span's last context), the largest engines where none does."""
        return self._keep("span", model, lambda: self._span(model))

    def _span(self, model: ModelSpec) -> Span:
        options = [(span_of(self.base, model, g), k, kv) for g, k, kv in self.layouts(model)]
        if len(options) == 1:
            one, k, _ = options[0]

            def span(batch: int, context: float, steps: int) -> float:
                return one(-(-batch // k), context, steps) if batch else 0.0
        else:
            slots = self.slots

            def span(batch: int, context: float, steps: int) -> float:
                if not batch:
                    return 0.0
                best = None
                for each, k, kv in options:
                    share = -(-batch // k)
                    if slots and share > slots or kv is not None and share * (context + steps) > kv:
                        continue
                    seconds = each(share, context, steps)
                    best = seconds if best is None or seconds < best else best
                if best is None:
                    each, k, _ = options[-1]
                    best = each(-(-batch // k), context, steps)
                return best

        return span

    def decode_span(self, model: ModelSpec, tp: int, batch: int, context: float, steps: int) -> float:
        return self.span_of(model, tp)(batch, context, steps)

    def decode_step(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> float:
        return self.span_of(model, tp)(batch, mean_context, 1)

    def prefill(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> float:
        """Prompts of ``seq_len`` tokens spread over the engines (one sequence, ``seq_len`` None, runs on one)."""
        seqs = 1 if not seq_len else max(1, -(-tokens // seq_len))

        def on(g: int, k: int) -> float:
            share = tokens if seqs == 1 else min(tokens, -(-seqs // k) * seq_len)
            return self.base.prefill(model, g, share, seq_len)

        return min(on(g, k) for g, k, _ in self.layouts(model))

    def max_batch(self, model: ModelSpec, tp: int, context_len: int) -> int:
        """Sequences of ``context_len`` tokens the memory of the instance's engines holds (elastic: the
        most of any layout); their slots are the job's (``SimSpec.capacity``)."""
        return max(k * self.base.max_batch(model, g, context_len) for g, k, _ in self.layouts(model))

    def kv_tokens(self, model: ModelSpec, tp: int) -> int | None:
        """KV cache tokens of the instance's engines together (elastic: the most of any layout)."""
        layouts = self.layouts(model)
        if any(kv is None for _, _, kv in layouts):
            return None
        return max(k * kv for _, k, kv in layouts)

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        return self.base.train_tokens(model, tokens, n_gpus, seq_len)

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        return self.base.optimizer_step(model, n_gpus)

    def regroup(self, model: ModelSpec, n_gpus: int) -> float:
        return self.base.regroup(model, n_gpus)

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        """Every engine loads the whole model over its own GPUs' links, all at once."""
        return self.base.shift(model, src, dst, tp if dst is Role.TRAIN else self.engine_tp)

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        return min(self.base.migration(model, g, tokens) for g, _, _ in self.layouts(model))

    def refresh(self, model: ModelSpec, tp: int) -> float:
        return self.base.refresh(model, self.engine_tp)

    def spread(self, kind: str) -> float:
        return self.base.spread(kind)


def role_costs(base: CostModel, tp: int, engine_tp: int, elastic: bool, slots: int = 0) -> CostModel:
    """What an instance of ``tp`` GPUs costs in a role run on engines of ``engine_tp`` GPUs (0: one
    engine of all of them) of ``slots`` sequences each: ``base`` itself where that is one engine and
    nothing is elastic."""
    engine_tp = engine_tp or tp
    if engine_tp == tp and not elastic:
        return base
    return EngineLayout(base, tp, engine_tp, elastic, slots)
