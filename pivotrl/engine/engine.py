"""Generation engine: continuous batching over a slotted KV cache.

Each running sequence owns one cache slot. A step either prefills newly
admitted sequences (their prompt, plus any tokens already generated when a
migrated sequence is resumed) or decodes one token for every running
sequence; finished sequences free their slot at once and waiting ones take it
on the next step, so the batch never waits for its longest member.

``abort(uid)`` takes a sequence out and returns its state (prompt, tokens so
far, log-probs, seed, sampling position); ``add(state)`` on any engine resumes
it. With counter-based sampling the resumed sequence yields the same tokens
as an uninterrupted run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pivotrl.engine.kv_budget import KVBudget, KVPlan
from pivotrl.engine.sampling import Rows, draw
from pivotrl.model.decoder import Decoder, KVCache

if TYPE_CHECKING:
    from pivotrl.engine.protocol import SliceReport
    from pivotrl.gps import Snapshot


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(slots=True)
class SeqState:
    """Everything needed to continue a sequence anywhere. Plain data, picklable."""

    uid: int
    prompt_ids: list[int]
    seed: int
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once done

    @property
    def position(self) -> int:
        """Sampling position: index of the next response token."""
        return len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    generated_tokens: int = 0  # tokens sampled (one per sequence per step)
    kv_read_tokens: int = 0  # context tokens the decode steps attended to, summed over steps and sequences


class Engine:
    """Continuous-batching generator for one model on one device.

    ``max_batch`` is the most sequences asked to run at once; ``kv_budget``
    (see :mod:`pivotrl.engine.kv_budget`) may cut the cache to fewer slots,
    ``self.max_batch`` then being the slots it holds: the rest wait their turn.
    """

    def __init__(
        self,
        model: Decoder,
        max_batch: int = 64,
        max_len: int = 512,
        max_prefill_tokens: int = 8192,
        kv_budget: KVBudget | None = None,
    ) -> None:
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.requested_batch, self.kv_budget = max_batch, kv_budget or KVBudget()
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[SeqState] = deque()
        self.running: dict[int, SeqState] = {}  # uid -> state
        self.slot_of: dict[int, int] = {}  # uid -> cache slot
        self.cached: dict[int, int] = {}  # uid -> tokens held in the cache
        self.stats = EngineStats()
        self._allocate(max_len)

    def _allocate(self, max_len: int) -> None:
        """(Re)build the cache for sequences of ``max_len`` tokens, as many slots as the budget holds."""
        self.plan: KVPlan = self.kv_budget.plan(self.model.config, self.dtype, max_len, self.requested_batch)
        self.cache = None  # type: ignore[assignment]  # free the old cache before the new one takes its place
        self.cache = KVCache(self.model.config, self.plan.slots, max_len, self.dtype, self.device)
        self.max_batch, self.max_len = self.plan.slots, max_len
        self.free_slots = list(range(self.max_batch - 1, -1, -1))

    # -- requests ---------------------------------------------------------
    def add(self, state: SeqState) -> None:
        """Queue a new sequence, or resume an aborted one (its tokens so far are re-prefilled)."""
        if state.done:
            raise ValueError(f"sequence {state.uid} is already finished ({state.finish_reason})")
        need = len(state.prompt_ids) + state.params.max_new_tokens
        if need > self.max_len:
            raise ValueError(
                f"sequence {state.uid}: prompt ({len(state.prompt_ids)}) + max_new_tokens "
                f"({state.params.max_new_tokens}) = {need} exceeds the engine's max_len {self.max_len}"
            )
        if not state.prompt_ids:
            raise ValueError(f"sequence {state.uid}: empty prompt")
        if state.uid in self.running or any(s.uid == state.uid for s in self.waiting):
            raise ValueError(f"sequence {state.uid} is already in this engine")
        self.waiting.append(state)

    def ensure_capacity(self, max_len: int) -> None:
        """Grow the KV cache to hold sequences of ``max_len`` tokens (only while idle); under a budget,
        longer sequences mean fewer slots."""
        if max_len <= self.max_len:
            return
        if self.has_work:
            raise RuntimeError("cannot resize the KV cache while sequences are in flight")
        self._allocate(max_len)

    def abort(self, uid: int) -> SeqState:
        """Take a waiting or running sequence out; returns its state for resumption elsewhere."""
        if uid in self.running:
            self._release(uid)
            self.stats.aborted += 1
            return self.running.pop(uid)
        for i, s in enumerate(self.waiting):
            if s.uid == uid:
                del self.waiting[i]
                self.stats.aborted += 1
                return s
        raise KeyError(f"sequence {uid} is not in this engine")

    def abort_all(self) -> list[SeqState]:
        return [self.abort(uid) for uid in [*self.running, *(s.uid for s in self.waiting)]]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- stepping ---------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[SeqState]:
        """One prefill or decode step. Returns the sequences that finished in it."""
        self.stats.steps += 1
        admitted = self._admit()
        if admitted:
            return self._run(admitted, prefill=True)
        if self.running:
            return self._run(list(self.running.values()), prefill=False)
        return []

    def generate(self, states: list[SeqState]) -> list[SeqState]:
        """Run the given sequences to completion (in input order)."""
        for s in states:
            self.add(s)
        while self.has_work:
            self.step()
        return states

    def run(self, seconds: float, clock: Callable[[], float]) -> SliceReport:
        """At least one step, then more until ``seconds`` of ``clock`` have passed.

        Prefill steps are timed apart from decode steps: their rate prices a
        migration's re-prefill.
        """
        from pivotrl.engine.protocol import SliceReport

        stats = self.stats
        report = SliceReport(running=self.load)
        before, kv0, t0 = stats.generated_tokens, stats.kv_read_tokens, clock()
        while self.has_work:
            p0, s0 = stats.prefill_tokens, clock()
            report.finished += self.step()
            if stats.prefill_tokens != p0:
                report.prefill_tokens += stats.prefill_tokens - p0
                report.prefill_s += clock() - s0
            else:
                report.steps += 1
            if clock() - t0 >= seconds:
                break
        report.tokens, report.kv = stats.generated_tokens - before, stats.kv_read_tokens - kv0
        report.progress = tuple((s.uid, len(s.output_ids)) for s in self.running.values())
        return report

    def load_weights(self, snap: Snapshot) -> None:
        """Copy a GPS version into the model in place (strict; see ``Snapshot.load_into``)."""
        if self.has_work:
            raise RuntimeError("cannot change weights while sequences are in flight")
        snap.load_into(self.model)

    def sleep(self) -> None:
        """Nothing to do: the native engine's memory is freed by its context (see ``GenerationContext``)."""

    def wake(self) -> None:
        """See :meth:`sleep`."""

    def _admit(self) -> list[SeqState]:
        admitted: list[SeqState] = []
        tokens = 0
        while self.waiting and self.free_slots:
            s = self.waiting[0]
            n = len(s.prompt_ids) + len(s.output_ids)
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.slot_of[s.uid] = self.free_slots.pop()
            self.cached[s.uid] = 0
            self.running[s.uid] = s
            admitted.append(s)
            tokens += n
        return admitted

    def _run(self, batch: list[SeqState], prefill: bool) -> list[SeqState]:
        dev = self.device
        if prefill:
            rows = [s.prompt_ids + s.output_ids for s in batch]
            width = max(map(len, rows))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=dev)
            lengths = torch.tensor([len(r) for r in rows], device=dev)
            start = torch.zeros(len(batch), dtype=torch.long, device=dev)
            self.stats.prefill_tokens += int(lengths.sum())
        else:
            ids = torch.tensor([[s.output_ids[-1]] for s in batch], device=dev)
            lengths = torch.ones(len(batch), dtype=torch.long, device=dev)
            cached = [self.cached[s.uid] for s in batch]
            start = torch.tensor(cached, device=dev)
            self.stats.decode_tokens += len(batch)
            self.stats.kv_read_tokens += sum(cached) + len(batch)  # the cache and the token fed
        slots = torch.tensor([self.slot_of[s.uid] for s in batch], device=dev)
        logits = self.model.forward_cached(ids, start, lengths, slots, self.cache)
        params = [s.params for s in batch]
        rows = Rows.build(
            [s.seed for s in batch],
            [s.position for s in batch],
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            dev,
        )
        tokens, logprobs = draw(logits, rows)
        finished = []
        self.stats.generated_tokens += len(batch)
        for s, n, tok, lp in zip(batch, lengths.tolist(), tokens.tolist(), logprobs.tolist(), strict=True):
            self.cached[s.uid] += n
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            if tok in s.params.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.output_ids) >= s.params.max_new_tokens:
                s.finish_reason = "length"
            if s.done:
                self._release(s.uid)
                del self.running[s.uid]
                self.stats.finished += 1
                finished.append(s)
        return finished

    def _release(self, uid: int) -> None:
        self.free_slots.append(self.slot_of.pop(uid))
        self.cached.pop(uid, None)
