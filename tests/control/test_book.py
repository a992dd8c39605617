"""The book of one step, alone: what it draws, and what it records as responses and judgments come in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pivotrl.control.book import StepBook
from pivotrl.control.messages import GenParams, GenResult, JudgeResult
from pivotrl.control.spec import LoopSpec, sequence_seed
from pivotrl.reward.genrm import GenRM
from pivotrl.sample import Problem, Status
from pivotrl.task.rules import exact_match

TRAIN_SET = [Problem(f"{a}+{a}", str(2 * a)) for a in range(1, 7)]
JUDGE = GenRM("{response}", "VERDICT: *(yes|no)", {"yes": 1.0, "no": 0.0}, 0.0)


def spec(**overrides) -> LoopSpec:
    base = LoopSpec(
        seed=3, steps=2, prompts_per_step=3, group_size=2, prompt_template="Q: {question}\nA:",
        rollout=GenParams(8, 1.0), judge=GenParams(8, 0.0), eval_params=GenParams(8, 0.0), eval_every=1,
        scale_by_std=False, per_device=4, check=exact_match,
    )  # fmt: skip
    return replace(base, **overrides)


def result(book: StepBook, uid: int, right: bool, length: int = 2, version: int = 0) -> GenResult:
    s = book.by_uid[uid]
    text = s.reference if right else s.reference + "0"
    return GenResult(uid, [1] * 4, [5] * length, [-0.5] * length, text, "stop", version)


def verdict(uid: int, yes: bool, tokens: int = 5) -> tuple[JudgeResult, object]:
    r = JudgeResult(uid, f"VERDICT: {'yes' if yes else 'no'}", False, tokens)
    return r, JUDGE.score(r.text, truncated=False)


def test_a_step_draws_its_prompts_by_seed_and_step_each_a_group_of_samples():
    book, reqs = StepBook.draw(spec(), 2, version=1, train_set=TRAIN_SET, now=4.0)
    again, _ = StepBook.draw(spec(), 2, version=1, train_set=TRAIN_SET, now=9.0)
    other, _ = StepBook.draw(spec(), 1, version=1, train_set=TRAIN_SET, now=4.0)
    assert [s.question for s in book.samples] == [s.question for s in again.samples]
    assert [s.question for s in book.samples] != [s.question for s in other.samples]
    assert [s.uid for s in book.samples] == [r.uid for r in reqs] == list(range(6))
    assert [s.prompt_index for s in book.samples] == [0, 0, 1, 1, 2, 2]
    assert [r.seed for r in reqs] == [sequence_seed(3, 2, uid) for uid in range(6)]
    assert all(s.policy_version == 1 for s in book.samples) and book.record.started == 4.0 and book.step == 2
    assert reqs[0].prompt == f"Q: {book.samples[0].question}\nA:" and reqs[0].params == spec().rollout
    assert book.gen_request(3) == reqs[3]  # a sample begun again is the same request
    chat = StepBook.draw(spec(chat=lambda p: f"<u>{p}</u>"), 2, 1, TRAIN_SET, 0.0)[1]
    assert chat[0].prompt == f"<u>{reqs[0].prompt}</u>"


def test_responses_complete_groups_and_the_rollout():
    book, _ = StepBook.draw(spec(), 1, 0, TRAIN_SET, 0.0)
    assert book.generated(result(book, 1, right=True), now=1.0) is None
    assert book.generated(result(book, 0, right=False, length=3), now=2.0) == 0  # group 0 is whole
    s = book.by_uid[1]
    assert s.correct is True and book.by_uid[0].correct is False and s.status is Status.FINISHED
    assert book.record.group_whole_at == {0: 2.0} and book.record.rollout_end is None
    assert book.reads(0) == 4 + 3 and book.tokens(0) == 4 + 3
    with pytest.raises(AssertionError, match="step 1, sample 2: policy v1 served it, -1 behind v0"):
        book.generated(result(book, 2, right=True, version=1), now=3.0)
    request = book.judge_request(0)
    assert (request.response, request.group, request.params) == (book.by_uid[0].reference + "0", 0, spec().judge)


def test_a_group_judged_whole_joins_the_queue_with_its_advantages():
    book, _ = StepBook.draw(spec(), 1, 0, TRAIN_SET, 0.0)
    for uid in range(6):
        book.generated(result(book, uid, right=uid % 2 == 0), now=10.0)
    assert book.record.rollout_end == 10.0 and book.groups_judging() == 3
    book.judged(*verdict(2, yes=True), now=11.0)
    book.judged(*verdict(0, yes=True), now=11.0)
    assert not book.queue and book.groups_judging() == 3
    book.judged(*verdict(1, yes=False, tokens=7), now=13.0)
    assert list(book.queue) == [0, 1] and book.record.advantages == pytest.approx({0: 0.5, 1: -0.5})
    assert book.record.group_waits == [3.0] and book.groups_judging() == 2
    assert book.by_uid[1].judge_tokens == 7 and book.by_uid[1].status is Status.JUDGED
    assert book.record.judge_tokens == 17 and not book.all_judged
    for uid in (3, 4, 5):
        book.judged(*verdict(uid, yes=False), now=14.0)
    assert book.all_judged and list(book.queue) == list(range(6))


def test_backward_takes_samples_to_the_nearest_share_and_gives_lost_ones_back_first():
    book, _ = StepBook.draw(spec(), 1, 0, TRAIN_SET, 0.0)
    for uid, n in enumerate([6, 6, 2, 2, 2, 2]):  # tokens: 10, 10, 6, 6, 6, 6
        book.generated(result(book, uid, right=True, length=n), now=0.0)
        book.judged(*verdict(uid, yes=True), now=0.0)
    assert book.groups_left(lockstep=False) == 3
    assert book.take(share=14.0) == [0]  # 10 + 10 / 2 > 14
    assert book.take(share=16.0) == [1, 2]  # 10 + 6 / 2 <= 16, 16 + 6 / 2 > 16
    shard = book.shard([1, 2])
    assert [len(r) for r in shard.response_ids] == [6, 2] and shard.advantages == (0.0, 0.0)
    book.record.accumulated = 1  # the first backward is done, the second in flight
    book.backward_lost([1, 2], in_flight=2)
    assert list(book.queue)[:2] == [1, 2] and book.record.backward == {0} and book.record.accumulated == 1
    assert book.groups_left(lockstep=False) == 3 and book.groups_left(lockstep=True) == 3
    assert [x.uid for x in book.not_backpropagated(lockstep=False)] == [1, 2, 3, 4, 5]
    assert len(list(book.not_backpropagated(lockstep=True))) == 6
    assert book.update_failed() == 6 and list(book.queue) == list(range(6)) and not book.record.backward
