"""What a schedule could reach: the joint floor's own rollout replayed on a fluid model of the cluster.

The joint floor (``pivotrl.sim.ideal``) is a bound, not a schedule. It prices every judgment at a full
batch's cost, and the judgment that ends a step at a batch of one's latency; a judge does not get both. This
replays the rollout the joint floor prices (its instances run by run, ``JointFloor.runs``), each response
ending when that rollout passes its length, with the floor's own judge (full-batch price, batch-1 latency:
a check of the replay and of the floor) or a batched judge (continuous batches on the instances the rollout
leaves free, a target batch per instance). Training is fluid: a group's backward runs on any free instance
once its last judgment is done (a lockstep trainer: every group after the step's last judgment). Nothing
else costs anything. ``benchmarks/reach.py`` runs it on the model groups.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from pivotrl.config import JobConfig
from pivotrl.control.messages import Role
from pivotrl.sim.driver import SimSpec
from pivotrl.sim.ideal import IdealStep, ideal_of
from pivotrl.sim.run import build
from pivotrl.sim.workload import quantiles

TARGETS = (4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
DT = 0.02  # seconds of a replay's time step


@dataclass(frozen=True, slots=True)
class StepWork:
    """The work of one step as the replay sees it, on the quantile grids the floor prices."""

    floor: IdealStep
    devices: int  # instances
    rollout_prefill_s: float
    runs: tuple[tuple[int, int, float, int], ...]  # the floor's rollout: (first step, steps, seconds, instances)
    ends: tuple[float, ...]  # per response: when the floor's rollout passes its length
    contexts: tuple[int, ...]  # per response: its judge prompt's tokens
    shared: int  # of which its group's judgments share (read once a group where the judge's cache is paged)
    judgments: tuple[int, ...]  # per response: its judgment's tokens
    groups: tuple[int, ...]  # per response: its group
    group_work: tuple[float, ...]  # per group: its backward, instance-seconds
    optimizer_s: float
    lockstep: bool


def step_of(cfg: JobConfig, spec: SimSpec, seed: int = 0) -> StepWork:
    """The step of job ``cfg`` on ``spec``'s cluster: the floor, its rollout, and what each response brings."""
    r = cfg.rollout
    n, size, prompts = r.prompts_per_step * r.group_size, r.group_size, r.prompts_per_step
    floor = ideal_of(cfg, spec)
    gs, jf = floor.gpu_seconds, floor.joint
    assert jf is not None  # (ideal_step always prices it)
    lengths = quantiles(spec.lengths, n, r.max_new_tokens)
    t, bounds = jf.prefill_s, []
    for start, steps, seconds, _ in jf.runs:
        bounds.append((start, steps, t, seconds))
        t += seconds

    def end(length: int) -> float:
        """When the rollout has written ``length`` tokens (its first came from the prefill)."""
        for start, steps, t0, seconds in bounds:
            if length <= start + steps:
                return t0 + seconds * max(0, length - start) / steps
        return t

    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    groups = tuple(order[i] // size for i in range(n))
    judged = quantiles(spec.judge_lengths, n, cfg.judge.max_new_tokens)
    rng.shuffle(judged)
    tokens = [size * spec.prompt_len] * prompts
    for g, length in zip(groups, lengths, strict=True):
        tokens[g] += length
    train = gs["train"] / spec.tp  # instance-seconds of the step's backward
    return StepWork(
        floor=floor,
        devices=spec.devices,
        rollout_prefill_s=jf.prefill_s,
        runs=jf.runs,
        ends=tuple(end(length) for length in lengths),
        contexts=tuple(spec.prompt_len + length + spec.judge_template_len for length in lengths),
        shared=spec.judge_shared_len if size > 1 else 0,
        judgments=tuple(judged),
        groups=groups,
        group_work=tuple(train * k / sum(tokens) for k in tokens),
        optimizer_s=floor.optimizer_s,
        lockstep=spec.lockstep_train,
    )


class _Rollout:
    """The instances the floor's rollout holds at a time (every one during its prefill, none after)."""

    def __init__(self, step: StepWork) -> None:
        self.edges: list[tuple[float, int]] = []
        t = step.rollout_prefill_s
        for _, _, seconds, instances in step.runs:
            t += seconds
            self.edges.append((t, instances))
        self.first, self.devices, self.k = step.rollout_prefill_s, step.devices, 0

    def at(self, t: float) -> int:
        if t < self.first:
            return self.devices
        while self.k < len(self.edges) and self.edges[self.k][0] <= t:
            self.k += 1
        return self.edges[self.k][1] if self.k < len(self.edges) else 0


def replay(
    step: StepWork, spec: SimSpec, target: int | None = None, dt: float = DT, cohort: int = 0, regroup_s: float = 0.0
) -> dict[str, float]:
    """One replay of ``step``: with the batched judge at target batch ``target``, or (None) the floor's judge.
    ``cohort`` (a lockstep trainer only; a what-if, not a trainer pivotrl has): at most that many instances
    backpropagate the groups judged so far, in lockstep among themselves, and at the last judgment the
    rest join them after ``regroup_s`` (a new group meets, the state resharded). Returns the step's seconds,
    the instance-seconds the judge held, and when the rollout and judging ended."""
    jc, model, tp = spec.role_costs(Role.JUDGE), spec.genrm, spec.tp
    capacity = spec.capacity(Role.JUDGE)
    n, d = len(step.ends), step.devices
    arrivals = sorted(range(n), key=lambda i: step.ends[i])
    rollout = _Rollout(step)
    members = [0] * len(step.group_work)
    for g in step.groups:
        members[g] += 1
    judged = [0] * len(step.group_work)
    floor_price = (step.floor.gpu_seconds["judge_prefill"] + step.floor.gpu_seconds["judge_decode"]) / tp / n
    queue: deque[int] = deque()
    reading: deque[list[float]] = deque()  # batched: [judgment, prefill instance-seconds left]
    decoding: list[tuple[float, int]] = []  # batched: (progress at which it is done, judgment)
    done_at: list[tuple[float, int]] = []  # floor's judge: (when it is done at the soonest, judgment)
    served = 0.0  # floor's judge: work left of the judgment at the queue's head
    progress, context_sum = 0.0, 0.0
    t, a, finished, groups_done, released, trained = 0.0, 0, 0, 0, 0.0, 0.0
    judge_held = judge_end = 0.0
    total_work = sum(step.group_work)
    stalled, formed, trained_early = 0.0, False, 0.0
    read: set[int] = set()  # the groups a judgment of which was read: the others read only their responses

    def cached(i: int) -> int:
        """The tokens of judgment ``i``'s prompt its judge reads from its cache (noting its group as read)."""
        g = step.groups[i]
        hit = step.shared if g in read else 0
        read.add(g)
        return hit

    def alone(i: int) -> float:
        """Judgment ``i`` by itself: its prompt read, its verdict written at batch 1."""
        c, o, s = step.contexts[i], step.judgments[i], cached(i)
        return jc.prefill(model, tp, c - s, c + s) + max(0, o - 1) * jc.decode_step(model, tp, 1, c + o / 2)

    def finish(i: int) -> None:
        nonlocal finished, groups_done, released, judge_end, trained_early
        finished += 1
        judge_end, trained_early = t, trained
        g = step.groups[i]
        judged[g] += 1
        if judged[g] == members[g]:
            groups_done += 1
            if not step.lockstep or cohort:
                released += step.group_work[g]
        if step.lockstep and finished == n and not cohort:
            released = total_work

    while groups_done < len(members) or trained < total_work - 1e-9:
        while a < n and step.ends[arrivals[a]] <= t:
            queue.append(arrivals[a])
            a += 1
        free = d - rollout.at(t)
        if step.lockstep and cohort and finished < n:
            # the cohort: once the first group is judged and as many instances are free, they train in lockstep
            # and stay in the train group (a device that left it would have the group meet again) to the step
            formed = formed or (released > 0 and free >= cohort)
            if formed:
                free -= cohort
        if target is None:  # the floor's judge: full-batch work, first in first out, on every free instance
            budget = free * dt
            while queue and budget > 0:
                take = min(budget, floor_price - served)
                served, budget = served + take, budget - take
                judge_held += take
                if served >= floor_price - 1e-12:
                    i = queue.popleft()
                    served = 0.0
                    heapq.heappush(done_at, (max(t + dt, step.ends[i] + alone(i)), i))
            while done_at and done_at[0][0] <= t:
                finish(heapq.heappop(done_at)[1])
            spare = budget
        else:
            held = len(reading) + len(decoding)
            want = len(queue) + held
            judges = min(free, max(1, math.ceil(want / target))) if want else 0
            while queue and len(reading) + len(decoding) < judges * capacity:
                i = queue.popleft()
                c, s = step.contexts[i], cached(i)
                reading.append([i, jc.prefill(model, tp, capacity * (c - s), c + s) / capacity])
            budget = judges * dt
            judge_held += budget if want else 0.0
            while reading and budget > 0:
                take = min(budget, reading[0][1])
                reading[0][1] -= take
                budget -= take
                if reading[0][1] <= 1e-12:
                    i = int(reading.popleft()[0])
                    heapq.heappush(decoding, (progress + max(1, step.judgments[i]) - 1, i))
                    context_sum += step.contexts[i] + step.judgments[i] / 2
            if decoding and judges:
                batch = max(1, min(capacity, round(len(decoding) / judges)))
                seconds = jc.decode_step(model, tp, batch, context_sum / len(decoding))
                progress += budget / judges / seconds
            while decoding and decoding[0][0] <= progress:
                i = heapq.heappop(decoding)[1]
                context_sum -= step.contexts[i] + step.judgments[i] / 2
                finish(i)
            spare = (free - judges) * dt
        if step.lockstep and cohort:  # the cohort alone until the last judgment, then a regroup, then all
            if finished < n:
                spare = cohort * dt if formed else 0.0
            elif stalled < regroup_s:
                stalled, spare = stalled + dt, 0.0
        trained += min(spare, released - trained)
        t += dt
        if t > 1e5:
            raise RuntimeError("replay: the step did not end (a judgment or a group never done)")
    return {"seconds": t + step.optimizer_s, "judge_instance_s": judge_held, "judging_ends_s": judge_end,
            "trained_by_last_judgment": trained_early,
            "rollout_ends_s": rollout.edges[-1][0] if rollout.edges else step.rollout_prefill_s}  # fmt: skip


def reach(
    cfg: JobConfig, targets: tuple[int, ...] = TARGETS, seed: int = 0, dt: float = DT, cohort: int = 0
) -> dict[str, Any]:
    """Both replays of job ``cfg``'s step: the floor's judge, and the batched judge at its best target
    (``cohort``: ``replay``'s what-if for a lockstep trainer, its regroup at the cost model's price)."""
    spec = build(cfg, warn=False).spec
    step = step_of(cfg, spec, seed)
    capacity = spec.capacity(Role.JUDGE)
    regroup = spec.costs.regroup(spec.policy, spec.devices * spec.tp) if cohort else 0.0
    check = replay(step, spec, None, dt, cohort, regroup)
    tried = {b: replay(step, spec, b, dt, cohort, regroup) for b in sorted({min(b, capacity) for b in targets})}
    best = min(tried, key=lambda b: tried[b]["seconds"])
    price = (step.floor.gpu_seconds["judge_prefill"] + step.floor.gpu_seconds["judge_decode"]) / spec.tp
    return {
        "floor_seconds": step.floor.floor_seconds,
        "joint_floor_seconds": step.floor.joint_floor_s,
        "lockstep_floor_seconds": step.floor.lockstep_floor_s,  # (0: the trainer backpropagates each group judged)
        "floors_judge": check,
        "batched": {str(b): r for b, r in tried.items()},
        "best_target": best,
        "best_seconds": tried[best]["seconds"],
        "judge_price_instance_s": price,
        "lockstep": step.lockstep,
        "cohort": cohort if step.lockstep else 0,
    }
