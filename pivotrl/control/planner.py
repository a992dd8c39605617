"""The planner of shiftable mode: when, and how many, devices move between roles.

It turns live demand (a ``Workload``) and measured ``Profiles`` (both in
``profiles.py``) into a decision, in three pure steps:

1. ``estimate``: a fluid model of the rest of the step gives, for one allocation
   (devices per role), the time until the step completes and when each phase ends.
2. ``Planner.plan``: every allocation is estimated, the devices that would move
   joining their new role only after their shift, and the requests they hold
   costing their re-prefill where they migrate. The best one replaces the current
   one only when it wins by more than a margin (hysteresis), and a device that
   just moved may not go back for a while (cooldown): demand that oscillates
   faster than shifts pay off must not make devices flap.
3. The devices that move are the cheapest to take: idle first, then the least
   loaded (fewest sequences to migrate), never pinned ones.

Every decision that moves something is logged with a one-line reason carrying
the numbers it was made from, so a timeline can be read next to the log.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pivotrl.control.messages import ROLES, Role
from pivotrl.control.profiles import LengthModel, Profiles, RoleProfile, ShiftCosts, TrainProfile, Workload, _positive

__all__ = [
    "LengthModel",
    "Profiles",
    "RoleProfile",
    "ShiftCosts",
    "TrainProfile",
    "Workload",
    "Planner",
    "estimate",
    "initial_split",
]

INF = math.inf
Alloc = tuple[int, int, int]  # devices on rollout, genrm, train (the order of ``ROLES``)
Move = tuple[int, Role | None, Role]  # device, role it leaves (None: it had none), role it takes


def _s(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < INF else "inf"


def fmt_alloc(alloc: Alloc | dict[Role, int]) -> str:
    """``r3 g1 t0``: the short form used in decision reasons and ``pivotrl plan``."""
    counts = tuple(alloc[r] for r in ROLES) if isinstance(alloc, dict) else alloc
    return " ".join(f"{r.value[0]}{n}" for r, n in zip(ROLES, counts, strict=True))


# -- the model ----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Work:
    """A workload reduced to the numbers the model needs, computed once per plan."""

    seqs: int
    queued: int  # sequences waiting for a device
    holders: int  # devices running the others (0: unknown)
    tokens: float  # expected tokens still to generate, all sequences
    longest: float  # expected remaining tokens of the longest-running sequence
    worst: float  # the most any sequence may still generate
    judge_items: int
    judge_queued: int
    judge_future: int
    judge_tokens: float
    judge_read: float  # prompt + response tokens every judgment left must still read (prefill)
    judge_read_queued: float  # of which the judgments queued or running
    judge_running: int  # of the queued, those in flight on a judge device: they finish there
    judge_holders: int  # the judge devices running them (0: unknown)
    judge_read_running: float  # what they still read (those not started)
    judge_left_running: float  # verdict tokens they are expected still to write
    judge_longest_running: float  # ... until the last of them ends: a judge that reasons writes some much longer
    groups: int
    ready: int  # groups whose backward can start now
    judging: int  # groups generated whole, whose backward starts once the judge queue drains
    group_tokens: float
    group_size: int  # samples per group: its backward splits over up to this many devices
    step_seconds: float
    gen_context: float  # tokens re-prefilled per migrated rollout sequence
    bulk_context: float  # mean context of the rollout's decode steps left, weighed by their tokens
    tail_context: float  # context of the longest sequence at the end of its expected rest
    judge_context: float  # tokens re-read per restarted judgment
    judge_fits: float  # judgments a judge device's paged KV cache holds at the context of those left (inf: no limit)
    judge_left_context: float | None  # mean context of the decode steps of judgments not yet on a device
    judge_wait_context: float | None  # ... of those waiting now (the others' responses still generate)
    judge_kv: float | None  # tokens a judge device's paged KV cache holds (None: no limit but its slots)
    judge_reread: float  # tokens a judge reads per token of the prompts and responses it judges (reads above have it)
    # the rest of the rollout on a grid of decode steps (``grid``, the last one ``longest``; empty when no
    # sequence is left): sequences still running halfway through each interval and their mean context
    # there; where the workload says which group each sequence is of (empty otherwise), training
    # sequences ended and groups generated whole by each point
    grid: tuple[float, ...] = ()
    alive: tuple[float, ...] = ()
    context: tuple[float, ...] = ()
    ended: tuple[float, ...] = ()
    whole: tuple[float, ...] = ()
    lockstep: bool = False  # every group's backward runs at the step, once all are judged (FSDP2)
    train_needed: int = 0  # the fewest train devices the optimizer step runs on (0: no step to run)
    memo: dict = field(default_factory=dict, compare=False)  # what every allocation of a plan asks alike


GRID = 8  # points of the rollout's remaining decode steps at which groups are expected to complete
BUCKET = 16  # tokens: sequences this close in progress share their completion chances


def _rollout_grid(w: Workload, lm: LengthModel, longest: float) -> dict[str, tuple[float, ...]]:
    """When the running sequences and their groups are expected to end, on ``GRID`` points of
    the decode steps left: a group is generated whole once every member has ended, each
    member ending independently at its own ``P(L <= t + x | L > t)``. The sequences still
    running at ``x`` have ``t + x`` tokens: their mean, with the prompt, is the context
    the decode steps there read. Groups (``ended``, ``whole``) only where the workload
    names them."""
    if not w.rollout_remaining or longest <= 0:
        return {}
    xs = [longest * (k + 1) / GRID for k in range(GRID)]
    mids = [longest * (k + 0.5) / GRID for k in range(GRID)]
    buckets = Counter(t - t % BUCKET for t in w.rollout_remaining)
    done = {b: lm.done_by(b, xs + mids) for b in buckets}
    alive = tuple(sum(n * (1.0 - done[b][GRID + k]) for b, n in buckets.items()) for k in range(GRID))
    held = [sum(n * (1.0 - done[b][GRID + k]) * (b + mids[k]) for b, n in buckets.items()) for k in range(GRID)]
    context = tuple(w.prompt_tokens_mean + (held[k] / alive[k] if alive[k] > 0 else mids[k]) for k in range(GRID))
    out = {"grid": tuple(xs), "alive": alive, "context": context}
    if not w.rollout_groups:
        return out
    members: dict[int, list[int]] = {}
    for t, g in zip(w.rollout_remaining, w.rollout_groups, strict=True):
        if g >= 0:
            members.setdefault(g, []).append(t - t % BUCKET)
    ended, whole = [0.0] * GRID, [0.0] * GRID
    for sig, n in Counter(tuple(sorted(m)) for m in members.values()).items():
        for k in range(GRID):
            p_all = 1.0
            for b in sig:
                p_all *= done[b][k]
                ended[k] += n * done[b][k]
            whole[k] += n * p_all
    return {**out, "ended": tuple(ended), "whole": tuple(whole)}


def _fits(kv: float | None, context: float, slots: float = INF) -> float:
    """Judgments of ``context`` tokens a judge device holds: its slots, or fewer where a paged KV cache of
    ``kv`` tokens (None: not paged) fills first; one at least."""
    return slots if kv is None else max(1.0, min(slots, kv // max(1.0, context)))


def _longest_judgment(judgments: LengthModel, written: dict[int, int], mean: float) -> float:
    """Verdict tokens until the last of some judgments ends (``written``: tokens so far -> how many); before
    the judgments seen say how they spread, one judgment's ``mean``."""
    return judgments.expected_longest(written) if judgments.samples >= judgments.min_samples else mean


def _longest_running(w: Workload, judgments: LengthModel) -> float:
    """Verdict tokens until the last running judgment ends, from what each has written (``BUCKET`` tokens apart
    share their chances; none written known: as many fresh ones)."""
    if not w.judge_running:
        return 0.0
    written = Counter(t - t % BUCKET for t in w.judge_written) if w.judge_written else {0: w.judge_running}
    return _longest_judgment(judgments, written, w.judge_tokens_mean)


def _generating_rest(w: Workload, expected: dict[int, float]) -> float:
    """Tokens the step's training responses still generating are expected still to write (held-out
    evaluation's, of group -1, train nothing)."""
    if not w.rollout_groups:
        return sum(expected[t] for t in w.rollout_remaining)
    return sum(expected[t] for t, g in zip(w.rollout_remaining, w.rollout_groups, strict=True) if g >= 0)


def _summarize(w: Workload, p: Profiles, judge_kv: float | None = None) -> _Work:
    lm, by_t = p.lengths, Counter(w.rollout_remaining)  # queued sequences share t=0: one lookup each
    exp = {t: lm.expected_remaining(t) for t in by_t}
    # the responses still generating train at the length they are expected to reach: the longest of the step,
    # which end last, are many groups' (counted at the mean length, a step's backward looks ever shorter)
    generating = _generating_rest(w, exp) / w.train_groups_left if w.train_groups_left else 0.0
    running = [t for t in w.rollout_remaining if t > 0]
    longest = lm.expected_longest(by_t)
    # a sequence with t tokens and e expected to come reads t + e/2 tokens (and the prompt) on average
    left = sum(exp[t] * n for t, n in by_t.items())
    held = sum(exp[t] * n * (t + exp[t] / 2) for t, n in by_t.items())
    # responses still generating are read once they end: prompt, tokens so far and their expected rest
    seqs = len(w.rollout_remaining)
    judge_read = w.judge_read_tokens + w.judge_future / max(1, seqs) * (
        seqs * w.prompt_tokens_mean + sum(w.rollout_remaining) + left
    )
    # a paged cache holds as many judgments as fit at their context: the prompts (and responses) the ones
    # not yet on a device read, and half a verdict; long responses, judged last, make the batches small
    judge_fits, judge_left_context, judge_wait_context = INF, None, None
    if (left_items := w.judge_queued + w.judge_future - w.judge_running) > 0:
        judge_left_context = (judge_read - w.judge_read_running) / left_items + w.judge_tokens_mean / 2
        judge_fits = _fits(judge_kv, judge_left_context)
    if (waiting := w.judge_queued - w.judge_running) > 0 and w.judge_read_tokens > w.judge_read_running:
        judge_wait_context = (w.judge_read_tokens - w.judge_read_running) / waiting + w.judge_tokens_mean / 2
    return _Work(
        seqs=len(w.rollout_remaining),
        queued=w.rollout_queued,
        holders=w.rollout_holders,
        tokens=sum(exp[t] * n for t, n in by_t.items()),
        longest=longest,
        worst=lm.max_remaining(min(by_t)) if by_t else 0.0,  # (the rest is longest for the fewest tokens so far)
        judge_items=w.judge_queued + w.judge_future,
        judge_queued=w.judge_queued,
        judge_running=w.judge_running,
        judge_holders=w.judge_holders,
        judge_read_running=w.judge_read_running * w.judge_reread,
        judge_left_running=w.judge_running * w.judge_tokens_mean
        if w.judge_left_running is None
        else w.judge_left_running,
        judge_longest_running=_longest_running(w, p.judgments),
        judge_future=w.judge_future,
        judge_tokens=w.judge_tokens_mean,
        judge_read_queued=w.judge_read_tokens * w.judge_reread,
        judge_read=judge_read * w.judge_reread,
        groups=w.train_groups_left,
        ready=min(w.train_groups_ready, w.train_groups_left),
        judging=min(w.train_groups_judging, max(0, w.train_groups_left - w.train_groups_ready)),
        group_tokens=w.train_tokens_per_group + generating,
        group_size=w.train_group_size,
        step_seconds=w.step_seconds,
        gen_context=w.prompt_tokens_mean + (sum(running) / len(running) if running else 0.0),
        bulk_context=w.prompt_tokens_mean + (held / left if left > 0 else 0.0),
        # the longest is likely among those that ran longest so far
        tail_context=w.prompt_tokens_mean + max(by_t, default=0) + longest,
        judge_context=w.prompt_tokens_mean + lm.mean + w.judge_tokens_mean / 2,
        judge_fits=judge_fits,
        judge_left_context=judge_left_context,
        judge_wait_context=judge_wait_context,
        judge_kv=judge_kv,
        judge_reread=w.judge_reread,
        lockstep=w.lockstep_train,
        train_needed=w.train_devices_needed,
        **_rollout_grid(w, lm, longest),
    )


@dataclass(slots=True, frozen=True)
class Estimate:
    """When each phase of the rest of the step ends (seconds from now) with ``alloc``."""

    alloc: Alloc
    rollout_end: float
    judge_end: float
    backward_end: float
    total: float  # the step completes: last phase + optimizer step
    seqs: int
    tail: bool  # the rollout end is bound by its longest sequence, not by throughput
    worst_rollout_end: float  # if the longest sequence runs to the longest length seen
    train_from: float  # the first backward can start (inf: no group left to train)

    def count(self, role: Role) -> int:
        return self.alloc[ROLES.index(role)]

    def describe(self) -> str:
        return (
            f"{fmt_alloc(self.alloc)}: rollout {self.rollout_end:.2f}s judge {self.judge_end:.2f}s "
            f"backward {self.backward_end:.2f}s step {self.total:.2f}s"
        )


def _drain(work: float, per_device: Callable[[int], float], arrivals: list[tuple[float, int]]) -> float:
    """Fluid completion time of ``work`` when devices join at the given times;
    ``per_device(n)`` is the rate of each of ``n`` devices sharing the work."""
    if work <= 0:
        return 0.0
    t, n, left = 0.0, 0, work
    for at, k in sorted(arrivals):
        if k <= 0 or at == INF:
            continue
        if n:
            rate = n * per_device(n)
            if t + left / rate <= at:
                return t + left / rate
            left -= rate * (at - t)
        t, n = at, n + k
    return t + left / (n * per_device(n)) if n else INF


def _fluid(work: list[tuple[float, float]], arrivals: list[tuple[float, int]], rate: float) -> float:
    """When work released at ``work`` (time, amount) is done by devices joining at ``arrivals``
    (time, count), each doing ``rate`` per second: the fluid model of ``_drain`` with work that
    is not all there from the start. (Devices are alike, so the work's order does not matter:
    first in first out is as fast as any.)"""
    pieces = sorted((at, x) for at, x in work if x > 0)
    return _fifo(pieces, arrivals, lambda n: rate)[-1] if pieces else 0.0


def _fifo(
    work: list[tuple[float, float]], arrivals: list[tuple[float, int]], per_device: Callable[[int], float]
) -> list[float]:
    """When each piece of work (release time, amount; in release order) is done, first in first
    out, by devices joining at ``arrivals``, each of ``n`` doing ``per_device(n)`` per second:
    ``_drain``'s fluid model with work released over time, each piece's end kept."""
    out = [INF] * len(work)
    joins = sorted((at, k) for at, k in arrivals if k > 0 and at < INF)
    now, n, j = 0.0, 0, 0
    for i, (at, left) in enumerate(work):
        now = max(now, at)  # the pieces before are done: devices idle until this one comes
        while True:
            while j < len(joins) and joins[j][0] <= now:
                n += joins[j][1]
                j += 1
            nxt = joins[j][0] if j < len(joins) else INF
            rate = n * per_device(n) if n else 0.0
            if left <= 0 or (rate > 0 and now + left / rate <= nxt):
                now += left / rate if left > 0 else 0.0
                break
            if nxt == INF:
                return out
            left -= rate * (nxt - now)
            now = nxt
        out[i] = now
    return out


def _left_at(work: list[tuple[float, float]], arrivals: list[tuple[float, int]], per_device: Callable[[int], float],
             at: float) -> float:  # fmt: skip
    """Work still undone at ``at`` of ``_fifo``'s (the same pieces, devices and rates)."""
    points = sorted({t for t, _ in work if t <= at} | {t for t, k in arrivals if k > 0 and t <= at} | {at})
    left, now, n = 0.0, 0.0, 0
    for t in points:
        if n and left > 0:
            left = max(0.0, left - n * per_device(n) * (t - now))
        now = t
        left += sum(x for r, x in work if r == t)
        n += sum(k for r, k in arrivals if r == t and k > 0)
    return left


def estimate(
    workload: Workload, profiles: Profiles, alloc: dict[Role, int], max_batch: Batch, judge_kv: float | None = None
) -> Estimate:
    """Seconds until the step completes with ``alloc`` devices per role from now on.

    A fluid model with the step's dependencies:

    - rollout ends at max(expected tokens left / throughput of its devices,
      when the longest sequence ends); the second bound is the tail: one step
      per token of the longest's expected rest, each step lengthened by the
      sequences batched with it, which more devices spread thinner (but a
      step never gets faster than a sequence alone);
    - judging runs on its devices from now, and cannot end before the rollout
      does plus one judgment;
    - the backward runs on the train devices from now (an optimistic bound:
      it waits for judged groups), and cannot end before judging does plus the
      last group's backward, its samples shared out over the train devices
      (up to one sample each); the optimizer step follows, and waits for the
      train devices still shifting in; it needs ``train_devices_needed`` of them
      (the trainer's state must fit), and an allocation that leaves fewer never ends.

    Devices of a phase that ends later in the step join the next phase with work
    when it ends, after the shift that takes them there (its measured cost):
    waiting for a phase to end is not free, so moving early and moving late are
    compared on equal terms. Moves made now are charged by the planner. Devices
    whose role has no work now stay idle: moving them is the decision at hand.
    A role with work and no device, now or later, never ends (inf).
    """
    w = _summarize(workload, profiles, judge_kv)
    return _estimate(w, profiles, tuple(alloc.get(r, 0) for r in ROLES), max_batch)


def _gen_rate(profile: RoleProfile, items: float, n: int, max_batch: int, context: float | None = None) -> float:
    """Tokens/s of each of ``n`` devices sharing ``items`` sequences evenly, of ``context`` tokens
    each (None: the profile's measured mean): devices beyond one per sequence idle."""
    per = items / n
    return profile.rate(min(max_batch, per), context) if per >= 1 else per * profile.rate(1, context)


def _memo_rate(
    w: _Work, profile: RoleProfile, items: float, n: int, max_batch: int, context: float | None = None
) -> float:
    """``_gen_rate``, remembered for the plan: every allocation asks for the same few."""
    key = (id(profile), n)
    rate = w.memo.get(key)
    if rate is None:
        rate = w.memo[key] = _gen_rate(profile, items, n, max_batch, context)
    return rate


Late = tuple[tuple[int, float], ...]  # per role (ROLES order): devices of the allocation still to arrive, and when
ON_TIME: Late = ((0, 0.0), (0, 0.0), (0, 0.0))


def _now_and_later(n: int, late: tuple[int, float]) -> list[tuple[float, int]]:
    k, at = late
    return [(0.0, n - k), (at, k)] if k else [(0.0, n)]


Batch = int | tuple[int, int]  # sequences one device runs at once: for both roles, or (rollout, judge)


def _estimate(w: _Work, p: Profiles, alloc: Alloc, max_batch: Batch, late: Late = ON_TIME) -> Estimate:
    n_r, n_g, n_t = alloc
    max_batch, judge_slots = max_batch if isinstance(max_batch, tuple) else (max_batch, max_batch)
    judge_batch = int(min(judge_slots, w.judge_fits))
    hop = p.costs.cost  # a device handed to the next phase pays its shift
    # rollout
    tail, taus = False, []
    if w.seqs == 0:
        t_r = worst = 0.0
    elif n_r == 0:
        t_r = worst = INF
    else:
        # running sequences stay where they are: rollout devices beyond those running them help only
        # with queued sequences (a device taken from the role hands its sequences to the others)
        useful = n_r if w.queued or not w.holders else min(n_r, w.holders)
        k_late = min(late[0][0], useful)
        rate = lambda n: _memo_rate(w, p.rollout, w.seqs, n, max_batch, w.bulk_context)  # noqa: E731
        bulk = _drain(w.tokens, rate, _now_and_later(useful, (k_late, late[0][1])))
        start = late[0][1] if late[0][0] == n_r else 0.0  # every rollout device is on its way
        slots = useful * max_batch
        if w.seqs > slots:  # the last sequences wait for a slot: about until the bulk before them is done
            start += bulk * (1 - slots / w.seqs)
        # the longest sequence takes one step per token, and each step also carries its batch-mates:
        # at each grid point the device's share of the sequences still running there, at their context
        # (a step in the tail reads long contexts; at a step's start, short ones)
        steps = w.memo.get(useful, [])
        if w.grid and not steps:
            acc, prev = 0.0, 0.0
            for x, alive, ctx in zip(w.grid, w.alive, w.context, strict=True):
                acc += (x - prev) * p.rollout.step_seconds(min(max_batch, max(1.0, alive / useful)), ctx)
                prev = x
                steps.append(acc)
            w.memo[useful] = steps
        last = start + (steps[-1] if steps else 0.0)
        t_r, tail = max(bulk, last), last >= bulk
        # past the longest expected, the longest seen: alone on its device
        worst = max(bulk, last + max(0.0, w.worst - w.longest) * p.rollout.step_seconds(1, w.tail_context))
        if steps and t_r < INF:  # the grid points' times, stretched to end with the rollout
            end = start + steps[-1]
            taus = [(start + t) * t_r / end for t in steps] if end > 0 else []
    handoff_r = 0.0 < t_r < INF  # rollout devices free up later in the step
    # judging
    t_g, t_q, r_judged = 0.0, 0.0, False
    judged_whole: list[float] = []
    if w.judge_items:
        ctx = w.judge_left_context  # (the judgments running read about as much: they came in the same order)
        judge_rate = lambda n: _memo_rate(w, p.judge, w.judge_items, n, judge_batch, ctx)  # noqa: E731
        # reading the judged responses counts as decode work at the rate of a full judge device
        per_read = judge_rate(max(1, n_g + n_r)) / p.judge.prefill_rate

        def slow(context: float | None) -> float:
            """A verdict token's work at ``context`` in units of one at the judgments' mean context: its
            decode step reads more, and fewer such judgments share it where the cache is paged."""
            if context is None or ctx is None:
                return 1.0
            key = ("slow", round(context))
            if key not in w.memo:
                fits = _fits(w.judge_kv, context, judge_slots)
                w.memo[key] = p.judge.rate(judge_batch, ctx) / p.judge.rate(fits, context)
            return w.memo[key]

        n_wait = w.judge_queued - w.judge_running
        queued = w.judge_running * w.judge_tokens + n_wait * w.judge_tokens * slow(w.judge_wait_context)
        queued += w.judge_read_queued * per_read
        latency = w.judge_tokens / p.judge.rate(1, ctx)  # the last judgment alone (one running may just start)

        def written_alone(tokens: float) -> float:
            """Seconds to write ``tokens`` of a verdict alone (a long one's batch-mates, shorter, are done by
            its end), at its own context: the longest, not the mean, of a judge that reasons outlasts the
            rest by many times one judgment."""
            return tokens * p.judge.step_seconds(1, None if ctx is None else ctx + (tokens - w.judge_tokens) / 2)

        def alone(count: float, start: float) -> float:
            """When the longest of ``count`` judgments started at ``start`` ends."""
            key = ("longest", max(1, round(count)))
            if key not in w.memo:
                w.memo[key] = written_alone(_longest_judgment(p.judgments, {0: key[1]}, w.judge_tokens))
            return start + w.memo[key]

        # the running judgments' longest, on its device; the longest waiting, started now at the soonest
        chain = written_alone(w.judge_longest_running)
        if n_wait > 0:
            chain = max(chain, alone(n_wait, 0.0))
        # judgments running stay where they run (moved, they would read their prompts again): their
        # devices finish them, in the batch they hold, before taking others (``held``, at ``t_held``);
        # judge devices beyond them help only with the judgments waiting and those to come
        present = n_g - min(late[1][0], n_g)
        holders = min(present, w.judge_holders) if w.judge_running else 0
        held = t_held = 0.0
        if holders:  # (priced at the holders' own batch: the judge devices beyond them do not share it)
            # the holders that stay keep their share of the running judgments; those of the devices the
            # allocation takes from the judge go back to the queue (``queued`` keeps their work)
            kept = holders / w.judge_holders if w.judge_holders > holders else 1.0
            running = w.judge_running * kept
            to_write = max(running, w.judge_left_running * kept)
            rate_held = _gen_rate(p.judge, running, holders, judge_batch, ctx)
            held = running * w.judge_tokens + w.judge_read_running * kept * per_read  # (in ``queued``'s units)
            t_held = (to_write / rate_held + w.judge_read_running * kept / p.judge.prefill_rate) / holders
            queued = max(0.0, queued - held)
        arrivals = [(0.0, present - holders), (t_held, holders)]
        if late[1][0]:
            arrivals.append((late[1][1], n_g - present))
        judging_only = list(arrivals)  # (the judge devices of the allocation, before the rollout's hand over)
        if handoff_r:
            arrivals.append((t_r + hop(Role.ROLLOUT, Role.GENRM), n_r))
        if taus and w.whole:  # the responses still generating come to be judged as they end, first in first out
            # a response ending at a grid point is read at the context there, and its verdict written beside
            # judgments as long: the longest, ending last, in the smallest batches
            half = w.judge_tokens / 2
            per_future = [w.judge_tokens * slow(c + half) + c * w.judge_reread * per_read for c in w.context]
            pieces, prev = [(0.0, queued)], 0.0
            for at, ended, per in zip(taus, w.ended, per_future, strict=True):
                pieces.append((at, (ended - prev) * per))
                prev = ended
            pieces.append((t_r, max(0.0, w.judge_future - prev) * per_future[-1]))
            judged = _fifo(pieces, arrivals, judge_rate)
            # the responses ending by each point are judged once the queue reaches them: the longest of
            # their judgments ends a chain (the last response's is rarely the longest judged)
            counts = [*(b - a for a, b in zip((0.0, *w.ended[:-1]), w.ended, strict=True)), w.judge_future - prev]
            for (at, _), before, count in zip(pieces[1:], judged[:-1], counts, strict=True):
                if count >= 0.5:
                    chain = max(chain, alone(count, max(at, before)))
            bulk, t_q = max(judged[-1], t_held), max(judged[0], t_held)  # t_q: those waiting now are done
            if handoff_r and n_g:
                # a judge device takes what its cache holds and keeps it: the judgments left when the rollout
                # ends are held by the judge devices there, up to a cache-full each of the longest, and the
                # devices joining then share only the rest
                cache = _fits(w.judge_kv, w.context[-1] + half, judge_slots) * per_future[-1]
                held_r = min(_left_at(pieces, judging_only, judge_rate, t_r) / n_g, cache)
                bulk = max(bulk, t_r + held_r / judge_rate(n_g))
            # the judge queue takes whole groups first: the judgments of the groups whole now (at most
            # all those waiting), then those of the groups whole by each point, judged ahead of the rest
            waiting = w.judge_queued - (w.judge_running if held else 0)  # the judgments ``queued`` is of
            now = min(queued, w.judging * w.group_size * queued / max(1, waiting))
            whole_pieces, prev_whole = [(0.0, now)], 0.0
            for at, whole, per in zip(taus, w.whole, per_future, strict=True):
                whole_pieces.append((at, (whole - prev_whole) * w.group_size * per))
                prev_whole = whole
            judged_whole = _fifo(whole_pieces, arrivals, judge_rate)
            if held:  # the groups whole now may wait for a judgment running: done by ``t_held``
                judged_whole[0] = max(judged_whole[0], t_held)
            # the judgments still waiting when the rollout ends run as one batch on every device then
            items = [w.judge_queued, *(b - a for a, b in zip((0.0, *w.ended[:-1]), w.ended, strict=True))]
            items.append(w.judge_future - prev)
            left = sum(n for n, end in zip(items, judged, strict=True) if end > t_r)
            batch = _fits(w.judge_kv, w.context[-1] + half, min(judge_batch, max(1.0, left / max(1, n_g + n_r))))
            last = w.judge_tokens * p.judge.step_seconds(batch, w.context[-1] + half)  # (the last are the longest)
        else:
            rest = w.judge_items * w.judge_tokens + w.judge_read * per_read - held
            bulk = max(t_held, _drain(rest, judge_rate, arrivals))
            t_q = max(t_held, _drain(queued, judge_rate, arrivals))
            last = latency
        t_g = max(bulk, latency, chain, t_r + last if w.judge_future else 0.0)
        r_judged = handoff_r and t_r < t_g
    # backward
    t_b, t_first = 0.0, INF
    if w.groups:
        t_first = 0.0
        arrivals = _now_and_later(n_t, late[2])
        if 0.0 < t_g < INF:
            arrivals.append((t_g + hop(Role.GENRM, Role.TRAIN), n_g + (n_r if r_judged else 0)))
        if handoff_r and not r_judged:
            arrivals.append((t_r + hop(Role.ROLLOUT, Role.TRAIN), n_r))
        # the last group's backward: its samples shared out over the train devices there will be
        spread = min(w.group_size, max(1, sum(k for _, k in arrivals)))
        group, rate = w.group_tokens / spread / p.train.device_rate, p.train.device_rate
        if w.lockstep and w.judge_items and 0.0 < t_g < INF:  # every group at the step, once the last is judged
            t_first = t_g
            bulk = _fluid([(t_g, w.groups * w.group_tokens)], arrivals, rate)
        elif w.judge_items and 0.0 < t_g < INF:
            # a group trains once its last response is judged: the groups judged now from now, those
            # generated whole once their judgments are done (the queue takes them first), the rest (a
            # response of theirs still generating, mostly the longest) when judging ends
            rest = w.groups - w.ready - w.judging
            chunks = [(0.0, w.ready), (min(judged_whole[0] if judged_whole else t_q, t_g), w.judging)]
            if taus and w.whole:  # groups generated whole at a grid point train once their judgments are done
                # (their turn in the queue, then a judgment beside those running on its device)
                batch = min(judge_batch, max(1.0, w.judge_queued / max(1, n_g)))
                running, prev = w.judge_tokens * p.judge.step_seconds(batch, ctx), 0.0
                for k, whole in enumerate(w.whole):
                    chunks.append((min(t_g, max(judged_whole[k + 1], taus[k]) + running), whole - prev))
                    prev = whole
                rest -= prev
            chunks.append((t_g, max(0.0, rest)))
            t_first, acc = t_g, 0.0  # when a whole group is expected to be trainable
            for at, k in sorted(chunks):
                acc += k
                if acc >= 1.0:
                    t_first = min(at, t_g)
                    break
            bulk = _fluid([(at, k * w.group_tokens) for at, k in chunks if k], arrivals, rate)
        else:
            bulk = _drain(w.groups * w.group_tokens, lambda n: rate, arrivals)
        t_b = max(bulk, group, t_g + group if w.judge_items else 0.0)
        if late[2][0]:  # the optimizer step waits for every train device, those still shifting in too
            t_b = max(t_b, late[2][1])
    # the optimizer step runs on as many train devices as hold the trainer's state: those there, and the devices
    # that phases ending with work hand over (a role without work keeps its devices idle: moving them is the plan's)
    at_step = n_t + (n_g if 0.0 < t_g < INF else 0) + (n_r if handoff_r else 0)
    total = max(t_r, t_g, t_b) + w.step_seconds if at_step >= w.train_needed else INF
    return Estimate(alloc, t_r, t_g, t_b, total, w.seqs, tail, worst, t_first)


def _allocations(devices: int, floor: Alloc) -> Iterator[Alloc]:
    for n_r in range(floor[0], devices - floor[1] - floor[2] + 1):
        for n_g in range(floor[1], devices - n_r - floor[2] + 1):
            yield n_r, n_g, devices - n_r - n_g


EXHAUSTIVE_UP_TO = 32  # devices; beyond, allocations are searched coarse to fine
COARSE = 12  # grid points per axis of a cluster's allocations
FINE = 3  # devices around the grid's best searched one by one


def _candidate_allocations(devices: int, floor: Alloc, counts: Alloc, total: Callable[[Alloc], float]) -> list[Alloc]:
    """Every allocation for a few devices. For many (a cluster's instances), a grid of
    about ``COARSE`` x ``COARSE`` allocations, then every allocation within half a grid cell
    (at most ``FINE`` devices) of the grid's best and within one device of the current one:
    about 150 estimates instead of ``devices^2 / 2`` on every plan."""
    if devices <= EXHAUSTIVE_UP_TO:
        return list(_allocations(devices, floor))
    k = -(-devices // COARSE)

    def axis(lo: int, hi: int) -> list[int]:
        return sorted({*range(lo, hi + 1, k), hi}) if hi >= lo else []

    grid = [
        (r, g, devices - r - g)
        for r in axis(floor[0], devices - floor[1] - floor[2])
        for g in axis(floor[1], devices - r - floor[2])
    ]
    best = min(grid, key=total)
    out = set(grid)
    for (cr, cg, _), radius in ((best, min(max(1, k // 2), FINE)), (counts, 1)):
        for r in range(max(floor[0], cr - radius), cr + radius + 1):
            for g in range(max(floor[1], cg - radius), cg + radius + 1):
                if devices - r - g >= floor[2]:
                    out.add((r, g, devices - r - g))
    return sorted(out)


def initial_split(workload: Workload, profiles: Profiles, devices: int, max_batch: int) -> dict[Role, int]:
    """The best allocation from scratch (no shift charged): the start split ``pivotrl plan``
    recommends. Ties go to more rollout devices, then more judge devices."""
    _positive("devices", devices)
    w = _summarize(workload, profiles)
    best = min(
        _allocations(devices, (0, 0, 0)),
        key=lambda a: (_estimate(w, profiles, a, max_batch).total, -a[0], -a[1]),
    )
    return dict(zip(ROLES, best, strict=True))


# -- decisions ----------------------------------------------------------------------------


@dataclass(slots=True)
class Decision:
    now: float
    targets: dict[int, Role]
    moves: list[Move]
    reason: str
    before: Estimate | None = None  # the allocation kept as the baseline
    after: Estimate | None = None  # the allocation chosen
    overhead: float = 0.0  # seconds charged for the moves
    wake: float = INF  # when to plan again at the latest: devices lent to the rollout are due in their role

    def row(self) -> dict[str, Any]:
        """The decision as a line of a run's ``decisions.jsonl``: when, the moves, and why."""
        moves = [[dev, src.value if src else None, dst.value] for dev, src, dst in self.moves]
        return {"t": round(self.now, 4), "moves": moves, "reason": self.reason}


@dataclass(slots=True)
class _Candidate:
    bound: float  # the estimate before migrations: a lower bound of total
    moved: int
    alloc: Alloc
    flows: dict[tuple[Role | None, Role], int]
    est: Estimate
    shift: float  # the slowest of the shifts, which run in parallel
    total: float = INF
    overhead: float = 0.0
    picked: bool = False  # devices chosen (``takes``); the moves are listed only for the one kept
    takes: list[tuple[Role, dict[Role, int], list[tuple[int, Role]] | None]] = field(default_factory=list)

    def key(self) -> tuple[float, int, Alloc]:
        return self.total, self.moved, self.alloc


def _flows(counts: Alloc, unassigned: int, alloc: Alloc) -> dict[tuple[Role | None, Role], int]:
    """Devices moving (from, to) to get from ``counts`` to ``alloc``: unassigned ones
    fill the roles short of devices first, then surplus roles give theirs. With
    three roles the rest is determined."""
    need = {r: max(0, a - c) for r, a, c in zip(ROLES, alloc, counts, strict=True)}
    give = {r: max(0, c - a) for r, a, c in zip(ROLES, alloc, counts, strict=True)}
    flows: dict[tuple[Role | None, Role], int] = {}
    for src, pool in ((None, unassigned), *give.items()):
        for dst in ROLES:
            k = min(pool, need[dst])
            if k:
                flows[(src, dst)] = k
                need[dst] -= k
                pool -= k
    return flows


class Planner:
    """Decides the role of every device, from demand and profiles, with hysteresis.

    ``hysteresis`` is the relative gain (of the current estimate) a change must
    bring beyond its overhead, ``min_gain_s`` the absolute one; a device that
    moved does not move back to the role it left within ``cooldown_s``.
    """

    def __init__(self, devices: int, hysteresis: float = 0.1, min_gain_s: float = 0.1, cooldown_s: float = 2.0) -> None:
        if devices < 1:
            raise ValueError(f"devices: got {devices}, must be >= 1")
        _positive("hysteresis", hysteresis, strict=False)
        _positive("min_gain_s", min_gain_s, strict=False)
        _positive("cooldown_s", cooldown_s, strict=False)
        self.devices, self.hysteresis, self.min_gain_s, self.cooldown_s = devices, hysteresis, min_gain_s, cooldown_s
        self.log: list[Decision] = []
        self._better_since: float | None = None  # since when some move has beaten keeping by its overhead
        self._left: dict[int, tuple[float, Role | None]] = {}  # device -> (when it last moved, role it left)

    def plan(
        self,
        now: float,
        current: dict[int, Role | None],
        busy: dict[int, int],
        pinned: set[int],
        workload: Workload,
        profiles: Profiles,
        max_batch: Batch,
        judge_kv: float | None = None,
    ) -> Decision:
        """The role of every device from now on. Every split of the devices is a candidate,
        pinned devices keeping theirs; a role may get none even with work left, since
        ``estimate`` hands it the devices of the phase before (or calls it never-ending).
        Devices with no role yet (None) always get one, with no margin to beat. ``judge_kv``:
        tokens a judge device's paged KV cache holds (None: its slots are the only limit)."""
        if set(current) != set(range(self.devices)):
            raise ValueError(f"current: names devices {sorted(current)}, expected 0..{self.devices - 1}")
        if not pinned <= set(current):
            raise ValueError(f"pinned: {sorted(pinned - set(current))} are not devices")
        for cap in max_batch if isinstance(max_batch, tuple) else (max_batch,):
            _positive("max_batch", cap)
        if judge_kv is not None:
            _positive("judge_kv", judge_kv)
        w = _summarize(workload, profiles, judge_kv)
        counts = tuple(sum(1 for r in current.values() if r is role) for role in ROLES)
        floor = tuple(sum(1 for d in pinned if current[d] is role) for role in ROLES)
        unassigned = sorted(d for d, r in current.items() if r is None and d not in pinned)
        movable = {r: sum(1 for d, x in current.items() if x is r and d not in pinned) for r in ROLES}
        made: dict[Alloc, _Candidate | None] = {}

        def candidate(alloc: Alloc) -> _Candidate | None:
            if alloc not in made:
                made[alloc] = self._candidate(alloc, counts, len(unassigned), movable, w, profiles, max_batch)
            return made[alloc]

        def bound(alloc: Alloc) -> float:
            c = candidate(alloc)
            return INF if c is None else c.bound

        total = sum(counts) + len(unassigned)
        cands = [c for a in _candidate_allocations(total, floor, counts, bound) if (c := candidate(a)) is not None]
        cands.sort(key=lambda c: (c.bound, c.moved, c.alloc))
        scene = _Scene(
            unassigned,
            busy,
            {src: sorted((d for d, r in current.items() if r is src and d not in pinned),
                         key=lambda d: (busy.get(d, 0), d)) for src in ROLES},
            {d: self._barred(d, now) for d in current},
            {Role.ROLLOUT: w.gen_context / profiles.rollout.prefill_rate,
             Role.GENRM: w.judge_context / profiles.judge.prefill_rate, Role.TRAIN: 0.0},
        )  # fmt: skip
        best, stay = _search(cands, scene)
        if best.total == INF and any(scene.barred.values()):
            # the cooldown must never stall a step: when no allowed allocation can finish it,
            # devices may go back to roles they just left
            scene = _Scene(scene.unassigned, busy, scene.orders, {}, scene.reprefill)
            best, stay = _search(cands, scene)
        alt = best if best is not stay else None
        if alt is None:  # the best alternative, to say in the log what keeping saved
            for c in sorted(cands, key=lambda c: (c.est.total, c.bound, c.moved, c.alloc)):
                if any(s is not None for s, _ in c.flows) and (c.picked or _pick(c, scene)):
                    alt = c
                    break
        chosen, reason = self._choose(alt, stay, w, now)
        moves = _moves(chosen, scene)
        lendable = _lendable(moves, current, pinned, w)
        needed = _train_needed(chosen, len(lendable), w, profiles, max_batch) if lendable else 0.0
        moves, wait = _lend(moves, lendable, needed, profiles.costs)
        if wait < INF:
            reason += f"; devices for train lent to the rollout for {_s(wait)}, until needed there"
        targets = {d: r for d, r in current.items() if r is not None}
        for d, _, dst in moves:
            targets[d] = dst
        decision = Decision(now, targets, moves, reason, stay.est, chosen.est, chosen.overhead, now + wait)
        if moves:
            for d, src, _ in moves:
                self._left[d] = (now, src)
            self.log.append(decision)
        return decision

    @staticmethod
    def _candidate(
        alloc: Alloc, counts: Alloc, unassigned: int, movable: dict[Role, int], w: _Work, p: Profiles, max_batch: Batch
    ) -> _Candidate | None:
        """``alloc`` as a candidate (None if it moves more devices of a role than may move), its
        moved devices joining their role after their shift."""
        flows = _flows(counts, unassigned, alloc)
        gives = Counter[Role]()
        for (src, _), k in flows.items():
            if src is not None:
                gives[src] += k
        if any(k > movable[r] for r, k in gives.items()):
            return None
        late = _late(flows, p.costs)
        est = _estimate(w, p, alloc, max_batch, late)
        shift = max((at for _, at in late), default=0.0)
        return _Candidate(est.total, sum(flows.values()), alloc, flows, est, shift)

    def _choose(self, alt: _Candidate | None, stay: _Candidate, w: _Work, now: float) -> tuple[_Candidate, str]:
        """Move to ``alt`` (the best allocation that moves a device holding a role) only if
        it beats keeping ``stay`` by its overhead plus the margin; say why either way.

        The margin guards against the estimate's noise, which makes the best alternative flicker
        between plans; a gain that lasts is no noise. So while some move keeps beating its overhead,
        plan after plan, the margin shrinks: it is gone once such gains have lasted as many seconds
        as the margin is long (a tenth of the step's rest, by default), and a move that wins by
        half the margin is taken after half that wait."""
        why = _situation(stay.est, w)
        base = stay.total
        if alt is None:
            self._better_since = None
            return stay, f"{why}: keep {fmt_alloc(stay.alloc)}, est {_s(base)}; no device can move"
        gain = base - alt.est.total
        margin = max(self.hysteresis * base, self.min_gain_s) if base < INF else 0.0
        held = ""
        if base < INF and alt.total < INF and gain > alt.overhead + self.min_gain_s:
            since = now if self._better_since is None else self._better_since
            self._better_since = since
            if now > since:
                margin = max(self.min_gain_s, margin - (now - since))
                held = f" (held {_s(now - since)})"
        else:
            self._better_since = None
        if alt.total < INF and (base == INF or gain > alt.overhead + margin):
            self._better_since = None
            return alt, (
                f"{why}: est {_s(base)} -> {_s(alt.est.total)} with {_delta(stay.alloc, alt.alloc)}; "
                f"gain {_s(gain)} > migration {_s(alt.overhead)} + margin {_s(margin)}{held}"
            )
        return stay, (
            f"{why}: keep {fmt_alloc(stay.alloc)}, est {_s(base)}; best move {fmt_alloc(alt.alloc)} "
            f"est {_s(alt.est.total)}, gain {_s(gain)} <= migration {_s(alt.overhead)} + margin {_s(margin)}{held}"
        )

    def _barred(self, device: int, now: float) -> Role | None:
        """The role ``device`` may not go back to yet (anti-flapping), if any."""
        when, left = self._left.get(device, (-INF, None))
        return left if now - when < self.cooldown_s else None


@dataclass(slots=True)
class _Scene:
    """What choosing devices for a candidate needs, computed once per plan."""

    unassigned: list[int]  # devices without a role, in order
    busy: dict[int, int]  # requests in flight per device
    orders: dict[Role, list[int]]  # movable devices of each role, least loaded first
    barred: dict[int, Role | None]  # the role each device may not go back to yet
    reprefill: dict[Role, float]  # seconds re-prefilling one request migrating from each role
    unbarred: dict[Role, int] = field(init=False)  # how many of each order come before the first barred
    prefix_busy: dict[Role, list[int]] = field(init=False)  # requests in flight on the first k of each order

    def __post_init__(self) -> None:
        self.unbarred, self.prefix_busy = {}, {}
        for role, order in self.orders.items():
            self.unbarred[role] = next((i for i, d in enumerate(order) if self.barred.get(d)), len(order))
            sums = [0]
            for d in order:
                sums.append(sums[-1] + self.busy.get(d, 0))
            self.prefix_busy[role] = sums


def _search(cands: list[_Candidate], scene: _Scene) -> tuple[_Candidate, _Candidate]:
    """The best candidate and the best that moves no device holding a role (``stay``),
    in order of their lower bounds, stopping once no later one can beat both."""
    best = stay = None
    for c in cands:
        if best is not None and stay is not None and c.bound > max(best.total, stay.total):
            break
        if not _pick(c, scene):
            continue
        if best is None or c.key() < best.key():
            best = c
        if not any(s is not None for s, _ in c.flows) and (stay is None or c.key() < stay.key()):
            stay = c
    if best is None or stay is None:  # cannot happen: keeping every role is always feasible
        raise AssertionError("planner: no feasible allocation")
    return best, stay


def _pick(c: _Candidate, scene: _Scene) -> bool:
    """Which devices make the candidate's moves: the least loaded, so the fewest
    sequences migrate, and none that would go back to a role it left within
    the cooldown. Sets the overhead (the slowest shift, plus the migrated
    requests' re-prefill shared by the devices that stay in their role);
    False if impossible. When none of the
    least loaded devices is barred they are simply the first of each role's
    order, priced from prefix sums without listing them (a cluster's plans
    weigh hundreds of candidates moving tens of devices)."""
    migrate, takes = 0.0, []
    for src in ROLES:
        slots = {dst: k for (s, dst), k in c.flows.items() if s is src}
        if not slots:
            continue
        k = sum(slots.values())
        if k <= scene.unbarred[src]:
            takes.append((src, slots, None))
            requests = scene.prefix_busy[src][k]
        else:
            chosen = _take(scene.orders[src], slots, scene.barred.get)
            if chosen is None:
                return False
            takes.append((src, slots, chosen))
            requests = sum(scene.busy.get(d, 0) for d, _ in chosen)
        # the devices staying in the role re-prefill the migrated requests side by side
        stay = max(1, c.alloc[ROLES.index(src)])
        migrate += requests * scene.reprefill[src] / stay
    c.takes, c.picked = takes, True
    c.overhead = migrate
    c.total = c.est.total + c.overhead
    return True


def _moves(c: _Candidate, scene: _Scene) -> list[Move]:
    """The moves of a picked candidate, device by device."""
    fresh = iter(scene.unassigned)
    moves: list[Move] = [(next(fresh), None, dst) for (src, dst), k in c.flows.items() if src is None for _ in range(k)]
    for src, slots, chosen in c.takes:
        if chosen is None:
            order = iter(scene.orders[src])
            chosen = [(next(order), dst) for dst, k in slots.items() for _ in range(k)]
        moves += [(d, src, dst) for d, dst in chosen]
    return sorted(moves, key=lambda m: m[0])


def _take(
    order: list[int], slots: dict[Role, int], barred: Callable[[int], Role | None]
) -> list[tuple[int, Role]] | None:
    """The cheapest devices (in ``order``) to fill ``slots`` (destination -> count), where a
    device may not go to its barred role. Greedy is optimal here: the constraints only cap
    how many devices barred from each destination may be taken (a partition matroid)."""
    total = sum(slots.values())
    chosen: list[int] = []
    capped = Counter[Role]()
    for d in order:
        if len(chosen) == total:
            break
        bar = barred(d)
        if bar in slots:
            if capped[bar] + 1 > total - slots[bar]:
                continue
            capped[bar] += 1
        chosen.append(d)
    if len(chosen) < total:
        return None
    left = dict(slots)
    out: list[tuple[int, Role]] = []
    flexible = []
    for d in chosen:
        bar = barred(d)
        if bar in slots:  # with two destinations, the other one; with one, never taken
            dst = next(r for r in slots if r is not bar)
            left[dst] -= 1
            out.append((d, dst))
        else:
            flexible.append(d)
    for d in flexible:
        dst = next(r for r in slots if left[r] > 0)
        left[dst] -= 1
        out.append((d, dst))
    return out


LEND_AFTER = 2.0  # round trips of shifts a train device must be able to generate for, to be lent


def _late(flows: dict[tuple[Role | None, Role], int], costs: ShiftCosts) -> Late:
    """Per role, the devices ``flows`` bring in and when the slowest of their shifts ends."""
    late = [[0, 0.0] for _ in ROLES]
    for (src, dst), k in flows.items():
        slot = late[ROLES.index(dst)]
        slot[0] += k
        slot[1] = max(slot[1], costs.cost(src, dst))
    return tuple((k, at) for k, at in late)


def _lendable(moves: list[Move], current: dict[int, Role | None], pinned: set[int], w: _Work) -> list[Move]:
    """The devices a plan has in train that could generate for now instead: those it moves there, and,
    when sequences wait for a device, those idle there (otherwise they would only take sequences from
    the others), as the moves that would put them on the rollout. None once the rollout is done."""
    if not w.seqs:
        return []
    out: list[Move] = [(d, src, src or Role.ROLLOUT) for d, src, dst in moves if dst is Role.TRAIN]
    if w.queued:
        moving = {d for d, _, _ in moves}
        out += [(d, Role.TRAIN, Role.ROLLOUT) for d, r in current.items()
                if r is Role.TRAIN and d not in pinned and d not in moving]  # fmt: skip
    return out


def _train_needed(c: _Candidate, lendable: int, w: _Work, p: Profiles, max_batch: Batch) -> float:
    """Seconds from now by which ``lendable`` of the candidate's train devices must be in train: the
    latest arrival that leaves its estimate as it is (the groups they will train are not judged yet),
    never before the first group can train."""
    if c.est.train_from == INF:
        return 0.0
    late = list(_late(c.flows, p.costs))
    base, first = c.est.total, max(late[2][1], c.est.train_from)

    def total(at: float) -> float:
        late[2] = (lendable, at)
        return _estimate(w, p, c.alloc, max_batch, tuple(late)).total

    slack = 1e-6 * max(1.0, base)
    if base == INF or total(first) > base + slack:
        return first
    lo, hi = first, base  # total(lo) holds; by ``base`` the step would be over
    if total(hi) <= base + slack:
        return hi
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= base + slack else (lo, mid)
    return lo


def _lend(moves: list[Move], lendable: list[Move], needed: float, costs: ShiftCosts) -> tuple[list[Move], float]:
    """The plan's moves, with the devices it has in train lent to the rollout until they are ``needed``
    there: until then they would idle, while the rollout ends sooner with them. (The estimate holds a
    role's devices from now until its phase ends, so moving now is the only way it can see them train
    before the rollout ends; it cannot see them generate in the meantime.) ``lendable`` (from
    ``_lendable``) says how: a device the plan takes out of the rollout or the judge for train stays
    where it is, one with no role yet starts on the rollout, an idle train device joins the rollout.
    Only if they can generate for ``LEND_AFTER`` round trips of shifts; also the seconds until they
    must leave for train (inf: none lent)."""
    to_train, back = costs.cost(Role.ROLLOUT, Role.TRAIN), costs.cost(Role.TRAIN, Role.ROLLOUT)
    wait = needed - to_train  # a device in train now would idle this long
    if not lendable or wait <= LEND_AFTER * (to_train + back):
        return moves, INF
    lent = {d for d, _, _ in lendable}
    kept = [m for m in moves if m[0] not in lent]
    return sorted(kept + [m for m in lendable if m[1] != m[2]], key=lambda m: m[0]), wait


def _situation(est: Estimate, w: _Work) -> str:
    """What the current allocation waits on, for the decision log."""
    if w.seqs and est.tail:
        return f"rollout tail: {w.seqs} seqs, longest ~{w.longest:.0f} tokens left"
    if w.seqs:
        return f"rollout: {w.seqs} seqs, ~{w.tokens:.0f} tokens left"
    if w.judge_items:
        return f"judge backlog: {w.judge_items} judgments"
    if w.groups:
        return f"train: {w.groups} groups left"
    return "idle"


def _delta(before: Alloc, after: Alloc) -> str:
    parts = [f"{r.value}{b - a:+d}" for r, a, b in zip(ROLES, before, after, strict=True) if b != a]
    return " ".join(parts)
