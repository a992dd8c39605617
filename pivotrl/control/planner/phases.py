"""The per-phase estimate: when each phase of the rest of the step (rollout, judging, backward, optimizer step)
ends with an allocation, from the work summary and the profiles, in the fluid model of ``fluid``."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from pivotrl.control.messages import ROLES, Role
from pivotrl.control.planner.alloc import INF, ON_TIME, Alloc, Batch, Late, fmt_alloc
from pivotrl.control.planner.fluid import Arrivals, Pieces, drain, fifo, fluid, left_at
from pivotrl.control.planner.memo import PlanMemo
from pivotrl.control.planner.work import Work, fits, longest_judgment, summarize
from pivotrl.control.profiles import Profiles, RoleProfile, Workload


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


@dataclass(slots=True, frozen=True)
class RolloutEnd:
    """How the rollout ends with an allocation."""

    end: float
    worst: float  # if the longest sequence runs to the longest length seen
    tail: bool = False  # the end is bound by the longest sequence, not by throughput
    reached: tuple[float, ...] = ()  # when the grid points are reached, stretched to end with the rollout

    @property
    def hands_over(self) -> bool:
        """The rollout's devices free up later in the step (and join the next phase with work)."""
        return 0.0 < self.end < INF


@dataclass(slots=True, frozen=True)
class JudgeEnd:
    """How judging ends with an allocation."""

    end: float = 0.0
    queue_end: float = 0.0  # the judgments waiting now are done
    whole_judged: tuple[float, ...] = ()  # the groups whole now, then those whole by each grid point, are judged
    takes_rollout: bool = False  # the rollout's devices join the judge (judging outlasts the rollout)


@dataclass(slots=True)
class _Judging:
    """One allocation's judge phase as it is worked out: its devices and the work they hold."""

    n_r: int
    n_g: int
    per_read: float  # decode work (verdict tokens at a full judge device's rate) per token read
    queued: float  # the judgments queued now, their holders' share taken out
    held: float  # the running judgments their holders keep (in ``queued``'s units)
    held_until: float  # ... done by then
    chain: float  # the longest single judgment's end, so far
    arrivals: Arrivals = field(default_factory=list)  # judge devices, as they come free to take judgments
    judging_only: Arrivals = field(default_factory=list)  # ... before the rollout's hand over


def gen_rate(profile: RoleProfile, items: float, n: int, max_batch: int, context: float | None = None) -> float:
    """Tokens/s of each of ``n`` devices sharing ``items`` sequences evenly, of ``context`` tokens
    each (None: the profile's measured mean): devices beyond one per sequence idle."""
    per = items / n
    return profile.rate(min(max_batch, per), context) if per >= 1 else per * profile.rate(1, context)


def now_and_later(n: int, late: tuple[int, float]) -> Arrivals:
    """``n`` devices of a role, the ``late[0]`` of them still shifting in arriving at ``late[1]``."""
    k, at = late
    return [(0.0, n - k), (at, k)] if k else [(0.0, n)]


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
    model = PhaseModel(summarize(workload, profiles, judge_kv), profiles, max_batch)
    return model.estimate(tuple(alloc.get(r, 0) for r in ROLES))


class PhaseModel:
    """The model of the rest of the step for one plan: a work summary, the profiles and the batch caps, which
    every allocation the plan weighs shares (so does its memo). ``estimate`` is the step's end with one."""

    def __init__(self, work: Work, profiles: Profiles, max_batch: Batch) -> None:
        self.work, self.profiles = work, profiles
        self.max_batch, self.judge_slots = max_batch if isinstance(max_batch, tuple) else (max_batch, max_batch)
        self.judge_batch = int(min(self.judge_slots, work.judge.fits))
        self.memo = PlanMemo()

    def estimate(self, alloc: Alloc, late: Late = ON_TIME) -> Estimate:
        """When each phase ends with ``alloc``, the devices ``late`` names of each role arriving only then."""
        n_r, n_g, n_t = alloc
        rollout = self.rollout(n_r, late[0])
        judge = self.judge(alloc, late, rollout)
        backward_end, train_from = self.backward(alloc, late, rollout, judge)
        # the optimizer step runs on as many train devices as hold the trainer's state: those there, and the devices
        # that phases ending with work hand over (a role without work keeps its devices idle: moving them is the plan's)
        at_step = n_t + (n_g if 0.0 < judge.end < INF else 0) + (n_r if rollout.hands_over else 0)
        t = self.work.train
        total = max(rollout.end, judge.end, backward_end) + t.step_seconds if at_step >= t.needed else INF
        return Estimate(
            alloc=alloc,
            rollout_end=rollout.end,
            judge_end=judge.end,
            backward_end=backward_end,
            total=total,
            seqs=self.work.rollout.seqs,
            tail=rollout.tail,
            worst_rollout_end=rollout.worst,
            train_from=train_from,
        )

    # -- rollout ------------------------------------------------------------------------------------------------

    def rollout(self, n_r: int, late: tuple[int, float]) -> RolloutEnd:
        """The rollout's end on ``n_r`` devices, ``late[0]`` of them arriving at ``late[1]``."""
        r, max_batch = self.work.rollout, self.max_batch
        if r.seqs == 0:
            return RolloutEnd(0.0, 0.0)
        if n_r == 0:
            return RolloutEnd(INF, INF)
        # running sequences stay where they are: rollout devices beyond those running them help only
        # with queued sequences (a device taken from the role hands its sequences to the others)
        useful = n_r if r.queued or not r.holders else min(n_r, r.holders)
        k_late = min(late[0], useful)
        bulk = drain(r.tokens, self._rollout_rate, now_and_later(useful, (k_late, late[1])))
        start = late[1] if late[0] == n_r else 0.0  # every rollout device is on its way
        slots = useful * max_batch
        if r.seqs > slots:  # the last sequences wait for a slot: about until the bulk before them is done
            start += bulk * (1 - slots / r.seqs)
        steps = self.memo.tail_steps(useful, lambda: self._tail_steps(useful)) if r.grid.points else []
        last = start + (steps[-1] if steps else 0.0)
        end, tail = max(bulk, last), last >= bulk
        # past the longest expected, the longest seen: alone on its device
        step_alone = self.profiles.rollout.step_seconds(1, r.tail_context)
        worst = max(bulk, last + max(0.0, r.worst - r.longest) * step_alone)
        reached: tuple[float, ...] = ()
        if steps and end < INF:  # the grid points' times, stretched to end with the rollout
            stretched = start + steps[-1]
            reached = tuple((start + t) * end / stretched for t in steps) if stretched > 0 else ()
        return RolloutEnd(end, worst, tail, reached)

    def _rollout_rate(self, n: int) -> float:
        r = self.work.rollout
        return self.memo.rate(
            Role.ROLLOUT, n, lambda: gen_rate(self.profiles.rollout, r.seqs, n, self.max_batch, r.bulk_context)
        )

    def _tail_steps(self, useful: int) -> list[float]:
        """The longest sequence takes one step per token, and each step also carries its batch-mates:
        at each grid point the device's share of the sequences still running there, at their context
        (a step in the tail reads long contexts; at a step's start, short ones)."""
        acc, prev, steps = 0.0, 0.0, []
        for point in self.work.rollout.grid.points:
            batch = min(self.max_batch, max(1.0, point.alive / useful))
            acc += (point.at - prev) * self.profiles.rollout.step_seconds(batch, point.context)
            prev = point.at
            steps.append(acc)
        return steps

    # -- judging ------------------------------------------------------------------------------------------------

    def judge(self, alloc: Alloc, late: Late, rollout: RolloutEnd) -> JudgeEnd:
        """Judging's end: the judgments queued and running now, and those of the responses still generating."""
        j, p = self.work.judge, self.profiles
        if not j.items:
            return JudgeEnd()
        q = self._judging(alloc, late, rollout)
        latency = j.tokens / p.judge.rate(1, j.left_context)  # the last judgment alone (one running may just start)
        if rollout.reached and self.work.rollout.grid.grouped:
            bulk, queue_end, whole, last = self._as_responses_end(q, rollout)
        else:
            rest = j.items * j.tokens + j.read * q.per_read - q.held
            bulk = max(q.held_until, drain(rest, self._judge_rate, q.arrivals))
            queue_end = max(q.held_until, drain(q.queued, self._judge_rate, q.arrivals))
            last, whole = latency, ()
        end = max(bulk, latency, q.chain, rollout.end + last if j.future else 0.0)
        return JudgeEnd(end, queue_end, whole, rollout.hands_over and rollout.end < end)

    def _judging(self, alloc: Alloc, late: Late, rollout: RolloutEnd) -> _Judging:
        """The judge's devices and work with ``alloc``: what is queued, what the running judgments' holders keep,
        and when each device comes free to take judgments."""
        j, p = self.work.judge, self.profiles
        n_r, n_g, _ = alloc
        # reading the judged responses counts as decode work at the rate of a full judge device
        per_read = self._judge_rate(max(1, n_g + n_r)) / p.judge.prefill_rate
        n_wait = j.queued - j.running
        queued = j.running * j.tokens + n_wait * j.tokens * self._slow(j.wait_context)
        queued += j.read_queued * per_read
        # the running judgments' longest, on its device; the longest waiting, started now at the soonest
        chain = self._written_alone(j.longest_running)
        if n_wait > 0:
            chain = max(chain, self._alone(n_wait, 0.0))
        # judgments running stay where they run (moved, they would read their prompts again): their
        # devices finish them, in the batch they hold, before taking others (``held``, at ``held_until``);
        # judge devices beyond them help only with the judgments waiting and those to come
        present = n_g - min(late[1][0], n_g)
        holders = min(present, j.holders) if j.running else 0
        held = held_until = 0.0
        if holders:  # (priced at the holders' own batch: the judge devices beyond them do not share it)
            # the holders that stay keep their share of the running judgments; those of the devices the
            # allocation takes from the judge go back to the queue (``queued`` keeps their work)
            kept = holders / j.holders if j.holders > holders else 1.0
            running = j.running * kept
            to_write = max(running, j.left_running * kept)
            # (the judgments running read about as much as those left: they came in the same order)
            rate_held = gen_rate(p.judge, running, holders, self.judge_batch, j.left_context)
            held = running * j.tokens + j.read_running * kept * per_read  # (in ``queued``'s units)
            held_until = (to_write / rate_held + j.read_running * kept / p.judge.prefill_rate) / holders
            queued = max(0.0, queued - held)
        arrivals = [(0.0, present - holders), (held_until, holders)]
        if late[1][0]:
            arrivals.append((late[1][1], n_g - present))
        judging_only = list(arrivals)  # (the judge devices of the allocation, before the rollout's hand over)
        if rollout.hands_over:  # a device handed to the next phase pays its shift
            arrivals.append((rollout.end + p.costs.cost(Role.ROLLOUT, Role.JUDGE), n_r))
        return _Judging(n_r, n_g, per_read, queued, held, held_until, chain, arrivals, judging_only)

    def _as_responses_end(self, q: _Judging, rollout: RolloutEnd) -> tuple[float, float, tuple[float, ...], float]:
        """The responses still generating come to be judged as they end, first in first out: when the judging
        ends in bulk, when the judgments waiting now are done, when each point's whole groups are judged, and
        how long the last batch takes after the rollout. Extends ``q.chain`` with the longest judgment of those
        ending by each point."""
        j, points = self.work.judge, self.work.rollout.grid.points
        pieces, per_future = self._future_pieces(q, rollout)
        judged = fifo(pieces, q.arrivals, self._judge_rate)
        # the responses ending by each point are judged once the queue reaches them: the longest of
        # their judgments ends a chain (the last response's is rarely the longest judged)
        counts = [*(b - a for a, b in pairwise((0.0, *(point.ended for point in points)))), j.future - points[-1].ended]
        for (at, _), before, count in zip(pieces[1:], judged[:-1], counts, strict=True):
            if count >= 0.5:
                q.chain = max(q.chain, self._alone(count, max(at, before)))
        bulk, queue_end = max(judged[-1], q.held_until), max(judged[0], q.held_until)
        if rollout.hands_over and q.n_g:
            # a judge device takes what its cache holds and keeps it: the judgments left when the rollout
            # ends are held by the judge devices there, up to a cache-full each of the longest, and the
            # devices joining then share only the rest
            cache = fits(j.kv, points[-1].context + j.tokens / 2, self.judge_slots) * per_future[-1]
            held_r = min(left_at(pieces, q.judging_only, self._judge_rate, rollout.end) / q.n_g, cache)
            bulk = max(bulk, rollout.end + held_r / self._judge_rate(q.n_g))
        whole = self._whole_judged(q, rollout, per_future)
        return bulk, queue_end, whole, self._last_batch(q, rollout, counts, judged)

    def _future_pieces(self, q: _Judging, rollout: RolloutEnd) -> tuple[Pieces, list[float]]:
        """The judge's work as it is released: the queue now, then the judgments of the responses ending by
        each grid point; and the work of one such judgment at each point. A response ending at a grid point is
        read at the context there, and its verdict written beside judgments as long: the longest, ending last,
        in the smallest batches."""
        j, points = self.work.judge, self.work.rollout.grid.points
        half = j.tokens / 2
        per_future = [j.tokens * self._slow(pt.context + half) + pt.context * j.reread * q.per_read for pt in points]
        pieces, prev = [(0.0, q.queued)], 0.0
        for at, point, per in zip(rollout.reached, points, per_future, strict=True):
            pieces.append((at, (point.ended - prev) * per))
            prev = point.ended
        pieces.append((rollout.end, max(0.0, j.future - prev) * per_future[-1]))
        return pieces, per_future

    def _whole_judged(self, q: _Judging, rollout: RolloutEnd, per_future: list[float]) -> tuple[float, ...]:
        """The judge queue takes whole groups first: when the judgments of the groups whole now (at most all
        those waiting) are done, then those of the groups whole by each point, judged ahead of the rest."""
        j, t = self.work.judge, self.work.train
        waiting = j.queued - (j.running if q.held else 0)  # the judgments ``q.queued`` is of
        now = min(q.queued, t.judging * t.group_size * q.queued / max(1, waiting))
        pieces, prev = [(0.0, now)], 0.0
        for at, point, per in zip(rollout.reached, self.work.rollout.grid.points, per_future, strict=True):
            pieces.append((at, (point.whole - prev) * t.group_size * per))
            prev = point.whole
        judged = fifo(pieces, q.arrivals, self._judge_rate)
        if q.held:  # the groups whole now may wait for a judgment running: done by ``q.held_until``
            judged[0] = max(judged[0], q.held_until)
        return tuple(judged)

    def _last_batch(self, q: _Judging, rollout: RolloutEnd, counts: list[float], judged: list[float]) -> float:
        """The judgments still waiting when the rollout ends run as one batch on every device then (the last
        are the longest): how long it takes. ``counts``: the judgments of the responses ending by each point;
        ``judged``: when the queue now and each point's judgments are done."""
        j, context = self.work.judge, self.work.rollout.grid.points[-1].context + self.work.judge.tokens / 2
        items = [j.queued, *counts]
        left = sum(n for n, end in zip(items, judged, strict=True) if end > rollout.end)
        batch = fits(j.kv, context, min(self.judge_batch, max(1.0, left / max(1, q.n_g + q.n_r))))
        return j.tokens * self.profiles.judge.step_seconds(batch, context)

    def _judge_rate(self, n: int) -> float:
        j = self.work.judge
        return self.memo.rate(
            Role.JUDGE, n, lambda: gen_rate(self.profiles.judge, j.items, n, self.judge_batch, j.left_context)
        )

    def _slow(self, context: float | None) -> float:
        """A verdict token's work at ``context`` in units of one at the judgments' mean context: its
        decode step reads more, and fewer such judgments share it where the cache is paged."""
        j, judge = self.work.judge, self.profiles.judge
        if context is None or j.left_context is None:
            return 1.0
        return self.memo.slowdown(
            round(context),
            lambda: (
                judge.rate(self.judge_batch, j.left_context)
                / judge.rate(fits(j.kv, context, self.judge_slots), context)
            ),
        )

    def _written_alone(self, tokens: float) -> float:
        """Seconds to write ``tokens`` of a verdict alone (a long one's batch-mates, shorter, are done by
        its end), at its own context: the longest, not the mean, of a judge that reasons outlasts the
        rest by many times one judgment."""
        j = self.work.judge
        context = None if j.left_context is None else j.left_context + (tokens - j.tokens) / 2
        return tokens * self.profiles.judge.step_seconds(1, context)

    def _alone(self, count: float, start: float) -> float:
        """When the longest of ``count`` judgments started at ``start`` ends."""
        j, n = self.work.judge, max(1, round(count))
        return start + self.memo.longest(
            n, lambda: self._written_alone(longest_judgment(self.profiles.judgments, {0: n}, j.tokens))
        )

    # -- backward -----------------------------------------------------------------------------------------------

    def backward(self, alloc: Alloc, late: Late, rollout: RolloutEnd, judge: JudgeEnd) -> tuple[float, float]:
        """When the last backward ends, and when the first can start (inf: no group left to train)."""
        t, p = self.work.train, self.profiles
        if not t.groups:
            return 0.0, INF
        n_r, n_g, n_t = alloc
        judged = bool(self.work.judge.items) and 0.0 < judge.end < INF
        arrivals = now_and_later(n_t, late[2])  # then the devices the phases before hand over, after their shift
        if 0.0 < judge.end < INF:
            arrivals.append(
                (judge.end + p.costs.cost(Role.JUDGE, Role.TRAIN), n_g + (n_r if judge.takes_rollout else 0))
            )
        if rollout.hands_over and not judge.takes_rollout:
            arrivals.append((rollout.end + p.costs.cost(Role.ROLLOUT, Role.TRAIN), n_r))
        # the last group's backward: its samples shared out over the train devices there will be
        spread = min(t.group_size, max(1, sum(k for _, k in arrivals)))
        group, rate = t.group_tokens / spread / p.train.device_rate, p.train.device_rate
        first = 0.0
        if t.lockstep and judged:  # every group at the step, once the last is judged
            first = judge.end
            bulk = fluid([(judge.end, t.groups * t.group_tokens)], arrivals, rate)
        elif judged:
            chunks = self._trainable(alloc, rollout, judge)
            first = _first_group(chunks, judge.end)
            bulk = fluid([(at, k * t.group_tokens) for at, k in chunks if k], arrivals, rate)
        else:
            bulk = drain(t.groups * t.group_tokens, lambda n: rate, arrivals)
        end = max(bulk, group, judge.end + group if self.work.judge.items else 0.0)
        if late[2][0]:  # the optimizer step waits for every train device, those still shifting in too
            end = max(end, late[2][1])
        return end, first

    def _trainable(self, alloc: Alloc, rollout: RolloutEnd, judge: JudgeEnd) -> list[tuple[float, float]]:
        """When groups become trainable (time, groups). A group trains once its last response is judged: the
        groups judged now from now, those generated whole once their judgments are done (the queue takes them
        first), the rest (a response of theirs still generating, mostly the longest) when judging ends."""
        t, j, points = self.work.train, self.work.judge, self.work.rollout.grid.points
        rest = t.groups - t.ready - t.judging
        whole_now = judge.whole_judged[0] if judge.whole_judged else judge.queue_end
        chunks = [(0.0, t.ready), (min(whole_now, judge.end), t.judging)]
        if rollout.reached and self.work.rollout.grid.grouped:
            # groups generated whole at a grid point train once their judgments are done (their turn in the
            # queue, then a judgment beside those running on its device)
            batch = min(self.judge_batch, max(1.0, j.queued / max(1, alloc[1])))
            running, prev = j.tokens * self.profiles.judge.step_seconds(batch, j.left_context), 0.0
            for k, point in enumerate(points):
                at = min(judge.end, max(judge.whole_judged[k + 1], rollout.reached[k]) + running)
                chunks.append((at, point.whole - prev))
                prev = point.whole
            rest -= prev
        chunks.append((judge.end, max(0.0, rest)))
        return chunks


def _first_group(chunks: list[tuple[float, float]], judge_end: float) -> float:
    """When a whole group is expected to be trainable, from when groups become so (at the latest when judging
    ends)."""
    first, acc = judge_end, 0.0
    for at, k in sorted(chunks):
        acc += k
        if acc >= 1.0:
            return min(at, judge_end)
    return first
