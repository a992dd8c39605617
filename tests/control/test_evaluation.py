"""Held-out evaluation, alone: its requests, its answers, its accuracies."""

from __future__ import annotations

import pytest

from pivotrl.control.evaluation import EVAL_STRIDE, EVAL_UID, Evaluation, is_eval
from pivotrl.control.messages import GenParams
from pivotrl.sample import Problem
from pivotrl.task.rules import exact_match

HELDOUT = [Problem(f"{a}*3", str(3 * a)) for a in range(1, 5)]
PARAMS = GenParams(8, 0.0)


def evaluation(heldout=HELDOUT, every: int = 2) -> Evaluation:
    return Evaluation(heldout, PARAMS, every, 5, lambda q: f"Q: {q}", exact_match)


def test_an_evaluation_scores_every_held_out_problem_then_reports_its_accuracy():
    ev = evaluation()
    reqs = ev.begin(3)
    assert [r.uid for r in reqs] == [EVAL_UID + 3 * EVAL_STRIDE + i for i in range(4)]
    assert all(is_eval(r.uid) for r in reqs)
    assert reqs[1].prompt == "Q: 2*3" and reqs[1].params == PARAMS and reqs[1].seed == 0
    assert ev.request(reqs[2].uid) == reqs[2]  # begun again from the start
    ev.begin(4)  # two evaluations in flight never mix
    assert list(ev.running) == [3, 4]
    assert [ev.answered(r.uid, p.reference) for r, p in zip(reqs[:3], HELDOUT[:3], strict=True)] == [False] * 3
    assert ev.answered(reqs[3].uid, "no") and ev.accuracy == {3: 0.75} and list(ev.running) == [4]


def test_evaluations_are_due_every_few_steps_and_after_the_last():
    assert [s for s in range(1, 6) if evaluation(every=2).due(s)] == [2, 4, 5]
    assert [s for s in range(1, 6) if evaluation(every=0).due(s)] == [5]
    assert not is_eval(EVAL_UID - 1)


def test_too_many_held_out_problems_are_refused():
    with pytest.raises(ValueError, match=f"at most {EVAL_STRIDE - 1} held-out problems"):
        evaluation(heldout=[HELDOUT[0]] * EVAL_STRIDE).begin(0)
