"""A modeled generation engine: continuous batching on one instance, on a virtual clock.

It holds what a real engine holds (running sequences, a waiting queue, at most
``capacity`` sequences at once) but never steps token by token. With
``kv_tokens`` its KV cache is paged, as in vLLM or SGLang: sequences share
that many tokens as they grow, a waiting one is admitted when its context fits
beside the others' (less a small watermark), and when a decode step would not
fit, the sequence admitted last is preempted: it goes back to the head of the
queue with its tokens so far and re-prefills them when admitted again
(recompute preemption). A paged cache keeps what it has read, as vLLM's and
SGLang's prefix caches do: a sequence of a ``group`` whose beginning
(``shared`` tokens: a judgment's template, question and reference) a sequence
of its group read here before, and still cached, prefills only the rest. A
beginning stays cached while a sequence of its group runs here, and after in
the cache's free room, the least recently read given up first for new
sequences. In a prefill pass the first of a group reads its beginning for the
others (vLLM caches a block as it allocates it).
Without a paged cache every sequence holds one of ``capacity`` fixed slots,
and nothing is cached (the runtime's CPU engine). A step is
either a prefill of newly admitted sequences (each samples its first token) or
a decode step of every running sequence, as in ``pivotrl.engine``. Between two
things that change the batch (a sequence finishing, waiting ones admitted) the
batch is fixed, so the cost model prices the whole run of decode steps at once
(``decode_span``) and the engine jumps to its end.

Nothing counts before its step completes: ``advance(until)`` commits the steps
that end by ``until``; a step that would end later is left for the next call
(an abort meanwhile finds the sequences with the tokens of their completed
steps). ``snapshot``/``restore`` let a driver plan ahead and take it back when
something arrives earlier than planned.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from pivotrl.sim.costs import CostModel, span_of, span_steps_within
from pivotrl.sim.models import ModelSpec


@dataclass(slots=True)
class SimSeq:
    """One sequence: ``target`` output tokens in all, ``base`` of them made before it came here.
    Never changed once made (snapshots share them); admission makes a new one with ``k0``."""

    uid: int
    prompt: int  # tokens before the output: prefilled (with ``base``) when it is admitted
    base: int
    target: int
    request: Any  # the request it answers, handed back on abort
    k0: int = 0  # the engine's decode-step count when its prefill completed (running sequences)
    group: int = -1  # sequences of one group (>= 0) begin with the same ``shared`` tokens of their prompts
    shared: int = 0


KV_WATERMARK = 0.01  # share of a paged cache kept free when admitting (vLLM's default), so that a
# sequence just admitted is not preempted by the next step's growth


class ModeledEngine:
    def __init__(
        self, costs: CostModel, model: ModelSpec, tp: int, capacity: int, now: float = 0.0,
        kv_tokens: int | None = None,
    ) -> None:  # fmt: skip
        if capacity < 1:
            raise ValueError(f"capacity: got {capacity}, must be >= 1 (the KV memory holds no sequence)")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens: got {kv_tokens}, must be >= 1 or None (fixed slots)")
        self.costs, self.model, self.tp, self.capacity, self.kv_tokens = costs, model, tp, capacity, kv_tokens
        self.preempted = 0  # sequences sent back to the queue because the paged cache was full
        self._span = span_of(costs, model, tp)  # decode_span of this instance: (batch, context, steps) -> seconds
        self.t = now  # end of the last completed step
        self.k = 0  # decode steps completed
        self.tokens = 0  # tokens sampled, prefill and decode
        self.prefill_tokens = 0  # tokens prefilled (prompts and migrated prefixes) ...
        self.prefill_seconds = 0.0  # ... and the time of those prefill steps
        self.kv_read = 0.0  # context tokens the decode steps attended to, summed over steps and sequences
        self.peak = 0  # the largest batch since the caller last reset it
        self.running: dict[int, SimSeq] = {}
        self.waiting: deque[SimSeq] = deque()
        self._finish: list[tuple[int, int]] = []  # heap of (decode step count at which it ends, uid)
        self._ctx = 0  # sum over running of prompt + base + 1 - k0: their mean context is _ctx / n + k
        # paged: the groups whose beginnings are cached (group -> tokens), least recently read first, and how many
        # sequences of each run here (a beginning a running sequence holds is not given up)
        self._cached: OrderedDict[int, int] = OrderedDict()
        self._holding: Counter[int] = Counter()

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: SimSeq, now: float) -> None:
        """Queue a sequence that arrives at ``now``; an idle engine does not start in the past."""
        if seq.base >= seq.target:
            raise ValueError(f"sequence {seq.uid}: {seq.base} tokens already, but it ends at {seq.target}")
        if not self.has_work:
            self.t = max(self.t, now)
        self.waiting.append(seq)

    def generated(self, seq: SimSeq) -> int:
        """Output tokens of a running sequence so far."""
        return seq.base + 1 + self.k - seq.k0

    def so_far(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.uid, s.base + 1 + self.k - s.k0) for s in self.running.values())

    def take_all(self) -> list[tuple[SimSeq, int]]:
        """Every sequence with its tokens so far (running first, then waiting), leaving the engine empty."""
        out = [(s, self.generated(s)) for s in self.running.values()] + [(s, s.base) for s in self.waiting]
        self.running, self.waiting, self._finish, self._ctx = {}, deque(), [], 0
        self._holding.clear()
        return out

    def take(self, uids: set[int]) -> list[tuple[SimSeq, int]]:
        """The sequences of ``uids`` still here, with their tokens so far, taken out (``take_all``'s shape)."""
        out = [(s, self.generated(s)) for u, s in self.running.items() if u in uids]
        for s, _ in out:
            del self.running[s.uid]
            self._ctx -= s.prompt + s.base + 1 - s.k0
            self._release(s)
        if out:
            self._finish = [f for f in self._finish if f[1] in self.running]
            heapq.heapify(self._finish)
        kept = deque()
        for s in self.waiting:
            if s.uid in uids:
                out.append((s, s.base))
            else:
                kept.append(s)
        self.waiting = kept
        return out

    def snapshot(self) -> tuple:
        return (self.t, self.k, self.tokens, self.prefill_tokens, self.prefill_seconds, self.kv_read, self.peak,
                self._ctx, self.preempted, dict(self.running), deque(self.waiting), list(self._finish),
                OrderedDict(self._cached), Counter(self._holding))  # fmt: skip

    def restore(self, snap: tuple) -> None:
        (self.t, self.k, self.tokens, self.prefill_tokens, self.prefill_seconds, self.kv_read, self.peak,
         self._ctx, self.preempted, running, waiting, finish, cached, holding) = snap  # fmt: skip
        self.running, self.waiting, self._finish = dict(running), deque(waiting), list(finish)
        self._cached, self._holding = OrderedDict(cached), Counter(holding)

    def advance(self, until: float) -> list[SimSeq]:
        """Run the steps that complete by ``until``; the sequences that finished in them."""
        finished: list[SimSeq] = []
        span = self._span
        while True:
            free = min(self.capacity - len(self.running), len(self.waiting))
            if free > 0 and self.kv_tokens is not None:
                free = self._fits(free)
            if free > 0:  # a prefill step admits as many as there are free slots
                batch = [self.waiting[i] for i in range(free)]
                cached, gone = self._cached_of(batch)
                seconds = self._prefill_seconds(batch, cached)
                if self.t + seconds > until:
                    break
                for g in gone:
                    del self._cached[g]
                for _ in batch:
                    self.waiting.popleft()
                self.t += seconds
                self.tokens += len(batch)
                self.prefill_tokens += sum(s.prompt + s.base for s in batch) - sum(cached)
                self.prefill_seconds += seconds
                for s in batch:
                    if self._caches(s) and not s.base:  # its beginning, read now or before, is the most recent
                        self._cached[s.group] = s.shared
                        self._cached.move_to_end(s.group)
                    if s.base + 1 >= s.target:
                        finished.append(s)
                        continue
                    r = SimSeq(s.uid, s.prompt, s.base, s.target, s.request, self.k, s.group, s.shared)
                    if self._caches(r):
                        self._holding[r.group] += 1
                    self.running[r.uid] = r
                    heapq.heappush(self._finish, (self.k + r.target - r.base - 1, r.uid))
                    self._ctx += r.prompt + r.base + 1 - self.k
                self.peak = max(self.peak, len(self.running))
                continue
            n = len(self.running)
            if not n:
                break
            steps = self._finish[0][0] - self.k
            full = False  # the paged cache fills before the next finish: a preemption ends the run
            if self.kv_tokens is not None:
                room = max(0, (self.kv_tokens - self._ctx - n * self.k) // n)  # decode steps it has room for
                if room < steps:
                    steps, full = room, True
                    if not steps:
                        self._preempt()
                        continue
            context = self._ctx / n + self.k
            seconds = span(n, context, steps)
            if self.t + seconds > until:  # the next finish is past ``until``: go as far as it allows
                part = span_steps_within(span, n, context, until - self.t, steps - 1)
                if part:
                    self.t += span(n, context, part)
                    self.k += part
                    self.tokens += part * n
                    self.kv_read += n * part * (context + (part - 1) / 2)
                break
            self.t += seconds
            self.k += steps
            self.tokens += steps * n
            self.kv_read += n * steps * (context + (steps - 1) / 2)  # each step reads one token more
            if full:
                self._preempt()
                continue
            while self._finish and self._finish[0][0] == self.k:
                s = self.running.pop(heapq.heappop(self._finish)[1])
                self._ctx -= s.prompt + s.base + 1 - s.k0
                self._release(s)
                finished.append(s)
        return finished

    def _caches(self, s: SimSeq) -> bool:
        """Whether the prefix cache keeps ``s``'s beginning: a paged cache, a sequence of a group."""
        return self.kv_tokens is not None and s.group >= 0 and s.shared > 0

    def _release(self, s: SimSeq) -> None:
        """``s`` no longer runs here: its group's beginning stays cached, held no more by it."""
        if self._caches(s):
            self._holding[s.group] -= 1
            if not self._holding[s.group]:
                del self._holding[s.group]

    def _cached_of(self, batch: list[SimSeq]) -> tuple[list[int], list[int]]:
        """Tokens each of ``batch`` (about to be admitted) reads from the prefix cache, and the beginnings given
        up first, once the pass completes: those no running sequence holds, least recently read first, until
        the rest fit in the cache's free room."""
        if self.kv_tokens is None:
            return [0] * len(batch), []
        cached, gone = self._cached, []
        unheld = [g for g in cached if g not in self._holding]
        spare = sum(cached[g] for g in unheld)
        free = self.kv_tokens - (self._ctx + len(self.running) * self.k)
        for g in unheld:  # (in the order they were last read)
            if spare <= free:
                break
            spare -= cached[g]
            gone.append(g)
        out, read = [], set(cached).difference(gone)
        for s in batch:  # (the first of a group in the pass reads its beginning for the others: its blocks are
            # cached as they are allocated, and the pass writes every layer's keys before it attends to them)
            hit = not s.base and self._caches(s)
            out.append(s.shared if hit and s.group in read else 0)
            if hit:
                read.add(s.group)
        return out, gone

    def _fits(self, most: int) -> int:
        """How many of the first ``most`` waiting sequences the paged cache admits now: their contexts
        after the prefill beside the running ones', less the watermark. One always fits in an empty
        engine (the job checks that the longest sequence fits alone)."""
        room = self.kv_tokens * (1 - KV_WATERMARK) - (self._ctx + len(self.running) * self.k)
        k = 0
        while k < most:
            s = self.waiting[k]
            room -= s.prompt + s.base + 1
            if room < 0:
                break
            k += 1
        return k if k or self.running else 1

    def _preempt(self) -> None:
        """The sequence admitted last goes back to the head of the queue with its tokens so far."""
        uid = next(reversed(self.running))
        s = self.running.pop(uid)
        self._ctx -= s.prompt + s.base + 1 - s.k0
        self._release(s)
        self._finish = [f for f in self._finish if f[1] != uid]
        heapq.heapify(self._finish)
        self.waiting.appendleft(SimSeq(uid, s.prompt, self.generated(s), s.target, s.request, 0, s.group, s.shared))
        self.preempted += 1

    def _prefill_seconds(self, batch: list[SimSeq], cached: list[int]) -> float:
        """New prompts in one prefill pass, less the ``cached`` beginning of each (its tokens still attend to it);
        a migrated sequence re-prefills its prompt and tokens so far."""
        # (the pass's attention priced at its token-weighted length: p for a prompt of p, p + c for its last
        # p - c tokens after c cached, each seeing c and half the rest on average)
        fresh = [(s.prompt - c, s.prompt + c) for s, c in zip(batch, cached, strict=True) if s.base == 0]
        seconds = 0.0
        if tokens := sum(n for n, _ in fresh):
            seq = round(sum(n * length for n, length in fresh) / tokens)
            seconds += self.costs.prefill(self.model, self.tp, tokens, seq)
        for s in batch:
            if s.base:
                seconds += self.costs.migration(self.model, self.tp, s.prompt + s.base)
        return seconds
