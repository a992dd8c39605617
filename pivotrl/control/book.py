"""The book of one step: its samples, which of its groups are generated and judged whole, their advantages, and
the judged samples waiting for their backward. It knows nothing of devices: the loop tells it what came back.

One step, one book: steps that overlap keep a book each. A sample's uid is its index in its step; its requests
carry ``base + uid``, the book's ``base`` telling the steps in flight apart (0 where one step runs at a time).
``by_uid`` and every method taking a uid speak of the requests' uids."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pivotrl.control.messages import GenRequest, GenResult, JudgeRequest, JudgeResult, TrainShard
from pivotrl.control.spec import STEP_UID, LoopSpec, sequence_seed
from pivotrl.reward.genrm import JudgeStats, Judgment
from pivotrl.sample import Problem, Sample, Status
from pivotrl.train.advantages import group_advantages


@dataclass(slots=True)
class StepRecord:
    step: int
    samples: list[Sample]
    started: float
    judge_stats: JudgeStats = field(default_factory=JudgeStats)
    judged: int = 0
    train_stats: dict[str, float] = field(default_factory=dict)
    finished: float | None = None
    shifts: int = 0
    shift_seconds: float = 0.0
    judge_tokens: int = 0
    judge_prefill_tokens: int = 0  # tokens the judge devices read: prompts, templates, preempted judgments again
    migrations: int = 0
    recovered: int = 0  # sequences and judgments begun again, and samples backpropagated again, after a lost device
    generated: int = 0
    group_judged: dict[int, int] = field(default_factory=dict)  # prompt index -> judged members
    group_generated: dict[int, int] = field(default_factory=dict)  # prompt index -> generated members
    group_whole_at: dict[int, float] = field(default_factory=dict)  # prompt index -> when its last member ended
    group_waits: list[float] = field(default_factory=list)  # per group judged: seconds from whole to judged whole
    groups_judged_at_rollout_end: int = 0  # groups whose backward could start when the rollout ended
    accumulated: int = 0  # samples whose backward is done
    backward: set[int] = field(default_factory=set)  # samples handed to a backward (indexes into samples)
    advantages: dict[int, float] = field(default_factory=dict)  # sample index -> advantage, once its group is judged
    rollout_end: float | None = None
    first_judged: float | None = None
    judge_end: float | None = None
    train_start: float | None = None


def token_runs(marks: list[tuple[int, int]], tokens: int, version: int) -> list[tuple[int, int]]:
    """(first token, version) of each run of a sequence's tokens that one version wrote: ``marks`` hold (tokens
    written, the version that wrote them) at each move, ``tokens`` and ``version`` its end."""
    runs: list[tuple[int, int]] = []
    start = 0
    for n, v in (*marks, (tokens, version)):
        if n > start or not runs:
            if not runs or runs[-1][1] != v:
                runs.append((start, v))
            start = max(start, n)
    return runs


class StepBook:
    """One step's samples as they are generated, judged and backpropagated (``record``, the step's record), the
    samples by uid, and the judged samples waiting for their backward (``queue``, indexes into the samples, a
    group's members together once the whole group is judged: its advantages need every reward)."""

    def __init__(self, record: StepRecord, spec: LoopSpec, base: int = 0) -> None:
        self.record, self.spec, self.group_size, self.base = record, spec, spec.group_size, base
        self.by_uid = {base + s.uid: s for s in record.samples}
        self.queue: deque[int] = deque()
        # partial rollouts: uid -> (tokens written so far, the version that wrote them) at each move of a sequence
        self.marks: dict[int, list[tuple[int, int]]] = {}

    @classmethod
    def draw(
        cls, spec: LoopSpec, step: int, version: int, train_set: list[Problem], now: float, base: int = 0
    ) -> tuple[StepBook, list[GenRequest]]:
        """The step's prompts, drawn from the training set by (seed, step), each ``group_size`` times, with the
        generation requests of its samples (uids from ``base``)."""
        rng = random.Random(spec.seed * 7919 + step)
        chosen = rng.sample(train_set, spec.prompts_per_step)
        samples, reqs = [], []
        for p_idx, prob in enumerate(chosen):
            prompt = spec.prompt(prob.question)
            for g in range(spec.group_size):
                uid = p_idx * spec.group_size + g
                seed = sequence_seed(spec.seed, step, uid)
                samples.append(Sample(uid, p_idx, prob.question, prob.reference, [], seed, policy_version=version))
                reqs.append(GenRequest(base + uid, prompt, seed, spec.rollout))
        return cls(StepRecord(step, samples, now), spec, base), reqs

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def samples(self) -> list[Sample]:
        return self.record.samples

    @property
    def all_judged(self) -> bool:
        return self.record.judged == len(self.record.samples)

    def group(self, p: int) -> range:
        """The indexes (and sample uids) of group ``p``'s samples."""
        return range(p * self.group_size, (p + 1) * self.group_size)

    def group_uids(self, p: int) -> range:
        """The uids of group ``p``'s requests."""
        return range(self.base + p * self.group_size, self.base + (p + 1) * self.group_size)

    def reads(self, uid: int) -> int:
        """Tokens a sample's judgment (and its backward) reads: its prompt and its response, fixed once it is
        generated. This is the work of judging it: where a decode step is bound by reading KV caches (a GPU's
        large batches), a judgment costs about its context at every step of its verdict and holds that much of
        the paged cache."""
        s = self.by_uid[uid]
        return len(s.prompt_ids) + len(s.response_ids)

    def tokens(self, i: int) -> int:
        """Tokens of sample ``i`` (an index) that its backward reads."""
        s = self.record.samples[i]
        return len(s.prompt_ids) + len(s.response_ids)

    def judge_request(self, uid: int) -> JudgeRequest:
        """The judgment of a generated sample, from the start."""
        s = self.by_uid[uid]
        judge = self.spec.judge
        group = self.base // STEP_UID * self.spec.prompts_per_step + s.prompt_index  # (apart from other steps')
        return JudgeRequest(uid, s.question, s.reference, s.response_text, s.seed, judge, group=group)

    def gen_request(self, uid: int) -> GenRequest:
        """A sample's generation from the start."""
        self.marks.pop(uid, None)
        s = self.by_uid[uid]
        return GenRequest(uid, self.spec.prompt(s.question), s.seed, self.spec.rollout)

    def generated(self, r: GenResult, now: float) -> int | None:
        """A sample's response is in (scored by the task's checker); returns its group if it completes it. Its
        policy version is the one that served it, at most ``spec.max_staleness`` behind the version the step
        trains (``step - 1``)."""
        s, rec = self.by_uid[r.uid], self.record
        runs = token_runs(self.marks.pop(r.uid, []), len(r.output_ids), r.version)
        first = runs[0][1]
        lag = rec.step - 1 - first
        assert 0 <= lag <= self.spec.max_staleness, (
            f"step {rec.step}, sample {s.uid}: policy v{first} served it, {lag} behind v{rec.step - 1} "
            f"(max_staleness {self.spec.max_staleness})"
        )
        s.policy_version, s.token_versions = first, runs if len(runs) > 1 else []
        s.prompt_ids, s.response_ids, s.logprobs, s.response_text = r.prompt_ids, r.output_ids, r.logprobs, r.text
        s.truncated = r.finish_reason == "length"
        s.status = Status.TRUNCATED if s.truncated else Status.FINISHED
        s.correct = self.spec.check(r.text, s.reference)
        rec.generated += 1
        generated = rec.group_generated[s.prompt_index] = rec.group_generated.get(s.prompt_index, 0) + 1
        if rec.generated == len(rec.samples):
            rec.rollout_end = now
            g = self.group_size
            rec.groups_judged_at_rollout_end = sum(n == g for n in rec.group_judged.values())
        if generated == self.group_size:
            rec.group_whole_at[s.prompt_index] = now
            return s.prompt_index
        return None

    def judged(self, r: JudgeResult, j: Judgment, now: float) -> None:
        """A sample's judgment is in (``j``, its verdict scored): once its group is judged whole, the group's
        samples join the queue with their advantages."""
        rec, s = self.record, self.by_uid[r.uid]
        rec.judge_stats.add(j)
        s.judge_text, s.judge_tokens, s.reward, s.verdict = r.text, r.tokens, j.reward, j.label
        s.status = Status.JUDGED
        rec.judged += 1
        rec.judge_tokens += r.tokens
        done = rec.group_judged.get(s.prompt_index, 0) + 1
        rec.group_judged[s.prompt_index] = done
        if done == self.group_size:  # the whole group is judged: its advantages are known
            self.queue_group(s.prompt_index)
            rec.group_waits.append(now - rec.group_whole_at.get(s.prompt_index, now))

    def queue_group(self, p: int) -> None:
        """A judged group's samples, with their advantages, join the queue."""
        samples, idx = self.record.samples, self.group(p)
        adv = group_advantages([samples[i].reward for i in idx], self.group_size, self.spec.scale_by_std)
        self.record.advantages.update(zip(idx, adv, strict=True))
        self.queue.extend(idx)

    def take(self, share: float) -> list[int]:
        """The next samples of the queue for one backward: one, then more while the tokens taken come nearer
        ``share`` (to the nearest sample); they count as handed to a backward."""
        queue, tokens_of = self.queue, self.tokens
        take = [queue.popleft()]
        tokens = tokens_of(take[0])
        while queue and tokens + tokens_of(queue[0]) / 2 <= share:
            take.append(queue.popleft())
            tokens += tokens_of(take[-1])
        self.record.backward.update(take)
        return take

    def shard(self, idx: list[int]) -> TrainShard:
        """Samples ``idx`` with their advantages, as one device's part of the update."""
        samples, adv = self.record.samples, self.record.advantages
        return TrainShard(
            tuple(samples[i].prompt_ids for i in idx),  # the samples' own lists, not copies: read-only
            tuple(samples[i].response_ids for i in idx),
            tuple(samples[i].logprobs for i in idx),
            tuple(adv[i] for i in idx),
        )

    def moved(self, uid: int, tokens: int, version: int) -> None:
        """A sequence leaves its device having written ``tokens`` tokens with policy ``version`` (kept where it goes
        on: a partial rollout's runs of versions are told from these marks)."""
        if tokens:
            self.marks.setdefault(uid, []).append((tokens, version))

    def migrated(self, uids: list[int]) -> None:
        """Sequences of samples ``uids`` moved to another device (generating or being judged)."""
        for uid in uids:
            self.by_uid[uid].migrations += 1
        self.record.migrations += len(uids)

    def backward_lost(self, held: list[int], in_flight: int) -> None:
        """Gradients of samples ``held`` are gone (their device was lost; ``in_flight`` of them were in a backward
        not yet reported done): they go through backward again, first."""
        rec = self.record
        rec.accumulated -= len(held) - in_flight
        rec.backward.difference_update(held)
        self.queue.extendleft(reversed(held))

    def update_failed(self) -> int:
        """The optimizer step failed: every judged sample goes through backward again. Returns how many."""
        rec = self.record
        rec.accumulated = 0
        rec.backward.clear()
        self.queue = deque(i for i in range(len(rec.samples)) if i in rec.advantages)
        return len(self.queue)

    def groups_left(self, lockstep: bool) -> int:
        """Groups whose backward is still to do (lockstep: a buffered group is not backpropagated until the
        optimizer step, so every group is)."""
        rec = self.record
        return -(-(len(rec.samples) - (0 if lockstep else rec.accumulated)) // self.group_size)

    def groups_judging(self) -> int:
        """Groups generated whole and not yet judged whole."""
        rec, g = self.record, self.group_size
        return sum(1 for p, n in rec.group_generated.items() if n == g and rec.group_judged.get(p, 0) < g)

    def not_backpropagated(self, lockstep: bool) -> Iterable[Sample]:
        """Samples whose backward is still to do (lockstep: every sample, the buffered ones too)."""
        backward = self.record.backward
        return (x for i, x in enumerate(self.record.samples) if lockstep or i not in backward)
