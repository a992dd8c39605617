"""The work summary: a ``Workload`` reduced once per plan to the numbers the model of the step reads, in one
record per phase (rollout, judge, train)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pivotrl.control.planner.alloc import INF
from pivotrl.control.profiles import LengthModel, Profiles, Workload

GRID = 8  # points of the rollout's remaining decode steps at which groups are expected to complete
BUCKET = 16  # tokens: sequences this close in progress share their completion chances


@dataclass(slots=True, frozen=True)
class GridPoint:
    """A point of the rollout's remaining decode steps and what is expected of it there."""

    at: float  # decode steps from now
    alive: float  # sequences still running halfway through the interval that ends here
    context: float  # their mean context there (prompt and tokens so far)
    ended: float = 0.0  # training sequences ended by here (counted only where the grid is ``grouped``)
    whole: float = 0.0  # groups generated whole by here (likewise)


@dataclass(slots=True, frozen=True)
class RolloutGrid:
    """The rest of the rollout on ``GRID`` points, the last one its longest sequence's expected end (no point
    when no sequence is left)."""

    points: tuple[GridPoint, ...] = ()
    grouped: bool = False  # the workload says which group each sequence is of: ``ended`` and ``whole`` count


@dataclass(slots=True, frozen=True)
class RolloutWork:
    """What the rollout has left."""

    seqs: int = 0
    queued: int = 0  # sequences waiting for a device
    holders: int = 0  # devices running the others (0: unknown)
    tokens: float = 0.0  # expected tokens still to generate, all sequences
    longest: float = 0.0  # expected remaining tokens of the longest-running sequence
    worst: float = 0.0  # the most any sequence may still generate
    gen_context: float = 0.0  # tokens re-prefilled per migrated rollout sequence
    bulk_context: float = 0.0  # mean context of the rollout's decode steps left, weighed by their tokens
    tail_context: float = 0.0  # context of the longest sequence at the end of its expected rest
    grid: RolloutGrid = field(default_factory=RolloutGrid)


@dataclass(slots=True, frozen=True)
class JudgeWork:
    """What the judge has left: the judgments queued (some running) and those of responses still generating."""

    items: int = 0  # judgments left: queued and future
    queued: int = 0
    future: int = 0
    tokens: float = 0.0  # verdict tokens of one judgment (the mean)
    read: float = 0.0  # prompt + response tokens every judgment left must still read (prefill)
    read_queued: float = 0.0  # of which the judgments queued or running
    running: int = 0  # of the queued, those in flight on a judge device: they finish there
    holders: int = 0  # the judge devices running them (0: unknown)
    read_running: float = 0.0  # what they still read (those not started)
    left_running: float = 0.0  # verdict tokens they are expected still to write
    longest_running: float = 0.0  # ... until the last of them ends: a judge that reasons writes some much longer
    context: float = 0.0  # tokens re-read per restarted judgment
    fits: float = INF  # judgments a judge device's paged KV cache holds at the context of those left (inf: no limit)
    left_context: float | None = None  # mean context of the decode steps of judgments not yet on a device
    wait_context: float | None = None  # ... of those waiting now (the others' responses still generate)
    kv: float | None = None  # tokens a judge device's paged KV cache holds (None: no limit but its slots)
    reread: float = 1.0  # tokens a judge reads per token of the prompts and responses it judges (reads above have it)


@dataclass(slots=True, frozen=True)
class TrainWork:
    """What the trainer has left: backward passes by group, then the optimizer step."""

    groups: int = 0
    ready: int = 0  # groups whose backward can start now
    judging: int = 0  # groups generated whole, whose backward starts once the judge queue drains
    group_tokens: float = 0.0
    group_size: int = 0  # samples per group: its backward splits over up to this many devices
    step_seconds: float = 0.0
    lockstep: bool = False  # every group's backward runs at the step, once all are judged (FSDP2)
    needed: int = 0  # the fewest train devices the optimizer step runs on (0: no step to run)


@dataclass(slots=True, frozen=True)
class Work:
    """A workload reduced to the numbers the model needs, computed once per plan."""

    rollout: RolloutWork
    judge: JudgeWork
    train: TrainWork


def summarize(w: Workload, p: Profiles, judge_kv: float | None = None) -> Work:
    """``w`` as the model of the step reads it, with the lengths and judgments ``p`` has seen; ``judge_kv``:
    tokens a judge device's paged KV cache holds (None: its slots are the only limit)."""
    lm, by_t = p.lengths, Counter(w.rollout_remaining)  # queued sequences share t=0: one lookup each
    expected = {t: lm.expected_remaining(t) for t in by_t}
    rollout = _rollout_work(w, lm, by_t, expected)
    return Work(rollout, _judge_work(w, p, judge_kv, rollout.tokens), _train_work(w, expected))


def _rollout_work(w: Workload, lm: LengthModel, by_t: Counter[int], expected: dict[int, float]) -> RolloutWork:
    running = [t for t in w.rollout_remaining if t > 0]
    longest = lm.expected_longest(by_t)
    # a sequence with t tokens and e expected to come reads t + e/2 tokens (and the prompt) on average
    left = sum(expected[t] * n for t, n in by_t.items())
    held = sum(expected[t] * n * (t + expected[t] / 2) for t, n in by_t.items())
    return RolloutWork(
        seqs=len(w.rollout_remaining),
        queued=w.rollout_queued,
        holders=w.rollout_holders,
        tokens=left,
        longest=longest,
        worst=lm.max_remaining(min(by_t)) if by_t else 0.0,  # (the rest is longest for the fewest tokens so far)
        gen_context=w.prompt_tokens_mean + (sum(running) / len(running) if running else 0.0),
        bulk_context=w.prompt_tokens_mean + (held / left if left > 0 else 0.0),
        # the longest is likely among those that ran longest so far
        tail_context=w.prompt_tokens_mean + max(by_t, default=0) + longest,
        grid=rollout_grid(w, lm, longest),
    )


def _judge_work(w: Workload, p: Profiles, judge_kv: float | None, rollout_left: float) -> JudgeWork:
    """``rollout_left``: the tokens the responses still generating are expected to add."""
    # responses still generating are read once they end: prompt, tokens so far and their expected rest
    seqs = len(w.rollout_remaining)
    judge_read = w.judge_read_tokens + w.judge_future / max(1, seqs) * (
        seqs * w.prompt_tokens_mean + sum(w.rollout_remaining) + rollout_left
    )
    # a paged cache holds as many judgments as fit at their context: the prompts (and responses) the ones
    # not yet on a device read, and half a verdict; long responses, judged last, make the batches small
    judge_fits, left_context, wait_context = INF, None, None
    if (left_items := w.judge_queued + w.judge_future - w.judge_running) > 0:
        left_context = (judge_read - w.judge_read_running) / left_items + w.judge_tokens_mean / 2
        judge_fits = fits(judge_kv, left_context)
    if (waiting := w.judge_queued - w.judge_running) > 0 and w.judge_read_tokens > w.judge_read_running:
        wait_context = (w.judge_read_tokens - w.judge_read_running) / waiting + w.judge_tokens_mean / 2
    return JudgeWork(
        items=w.judge_queued + w.judge_future,
        queued=w.judge_queued,
        future=w.judge_future,
        tokens=w.judge_tokens_mean,
        read=judge_read * w.judge_reread,
        read_queued=w.judge_read_tokens * w.judge_reread,
        running=w.judge_running,
        holders=w.judge_holders,
        read_running=w.judge_read_running * w.judge_reread,
        left_running=w.judge_running * w.judge_tokens_mean if w.judge_left_running is None else w.judge_left_running,
        longest_running=_longest_running(w, p.judgments),
        context=w.prompt_tokens_mean + p.lengths.mean + w.judge_tokens_mean / 2,
        fits=judge_fits,
        left_context=left_context,
        wait_context=wait_context,
        kv=judge_kv,
        reread=w.judge_reread,
    )


def _train_work(w: Workload, expected: dict[int, float]) -> TrainWork:
    # the responses still generating train at the length they are expected to reach: the longest of the step,
    # which end last, are many groups' (counted at the mean length, a step's backward looks ever shorter)
    generating = _generating_rest(w, expected) / w.train_groups_left if w.train_groups_left else 0.0
    return TrainWork(
        groups=w.train_groups_left,
        ready=min(w.train_groups_ready, w.train_groups_left),
        judging=min(w.train_groups_judging, max(0, w.train_groups_left - w.train_groups_ready)),
        group_tokens=w.train_tokens_per_group + generating,
        group_size=w.train_group_size,
        step_seconds=w.step_seconds,
        lockstep=w.lockstep_train,
        needed=w.train_devices_needed,
    )


def rollout_grid(w: Workload, lm: LengthModel, longest: float) -> RolloutGrid:
    """When the running sequences and their groups are expected to end, on ``GRID`` points of
    the decode steps left: a group is generated whole once every member has ended, each
    member ending independently at its own ``P(L <= t + x | L > t)``. The sequences still
    running at ``x`` have ``t + x`` tokens: their mean, with the prompt, is the context
    the decode steps there read. Groups (``ended``, ``whole``) only where the workload
    names them."""
    if not w.rollout_remaining or longest <= 0:
        return RolloutGrid()
    xs = [longest * (k + 1) / GRID for k in range(GRID)]
    mids = [longest * (k + 0.5) / GRID for k in range(GRID)]
    buckets = Counter(t - t % BUCKET for t in w.rollout_remaining)
    done = {b: lm.done_by(b, xs + mids) for b in buckets}
    alive = [sum(n * (1.0 - done[b][GRID + k]) for b, n in buckets.items()) for k in range(GRID)]
    held = [sum(n * (1.0 - done[b][GRID + k]) * (b + mids[k]) for b, n in buckets.items()) for k in range(GRID)]
    context = [w.prompt_tokens_mean + (held[k] / alive[k] if alive[k] > 0 else mids[k]) for k in range(GRID)]
    if not w.rollout_groups:
        return RolloutGrid(tuple(GridPoint(*point) for point in zip(xs, alive, context, strict=True)))
    ended, whole = _groups_ended(w, done)
    points = zip(xs, alive, context, ended, whole, strict=True)
    return RolloutGrid(tuple(GridPoint(*point) for point in points), grouped=True)


def _groups_ended(w: Workload, done: dict[int, list[float]]) -> tuple[list[float], list[float]]:
    """Training sequences ended and groups generated whole by each grid point (``done``: per bucket of tokens
    so far, the chance to have ended by each point)."""
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
    return ended, whole


def fits(kv: float | None, context: float, slots: float = INF) -> float:
    """Judgments of ``context`` tokens a judge device holds: its slots, or fewer where a paged KV cache of
    ``kv`` tokens (None: not paged) fills first; one at least."""
    return slots if kv is None else max(1.0, min(slots, kv // max(1.0, context)))


def longest_judgment(judgments: LengthModel, written: dict[int, int], mean: float) -> float:
    """Verdict tokens until the last of some judgments ends (``written``: tokens so far -> how many); before
    the judgments seen say how they spread, one judgment's ``mean``."""
    return judgments.expected_longest(written) if judgments.samples >= judgments.min_samples else mean


def _longest_running(w: Workload, judgments: LengthModel) -> float:
    """Verdict tokens until the last running judgment ends, from what each has written (``BUCKET`` tokens apart
    share their chances; none written known: as many fresh ones)."""
    if not w.judge_running:
        return 0.0
    written = Counter(t - t % BUCKET for t in w.judge_written) if w.judge_written else {0: w.judge_running}
    return longest_judgment(judgments, written, w.judge_tokens_mean)


def _generating_rest(w: Workload, expected: dict[int, float]) -> float:
    """Tokens the step's training responses still generating are expected still to write (held-out
    evaluation's, of group -1, train nothing)."""
    if not w.rollout_groups:
        return sum(expected[t] for t in w.rollout_remaining)
    return sum(expected[t] for t, g in zip(w.rollout_remaining, w.rollout_groups, strict=True) if g >= 0)
