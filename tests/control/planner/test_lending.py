"""Lending: train devices that generate for the rollout until the trainer needs them."""

from __future__ import annotations

import math

import pytest

from pivotrl.control.planner import PhaseModel, Workload, summarize
from pivotrl.control.planner.lending import lend, lendable, train_needed
from pivotrl.control.planner.search import candidate
from tests.control.planner.cases import MAX_BATCH, G, R, T, profiles


def _fresh_step(**kw) -> Workload:
    """The start of a step: 8 sequences queued, in 2 groups, nothing generated or judged yet."""
    base = dict(rollout_remaining=[0] * 8, rollout_groups=[0] * 4 + [1] * 4, rollout_queued=8, judge_future=8,
                train_groups_left=2, train_tokens_per_group=1000)  # fmt: skip
    return Workload(**{**base, **kw})


LENDABLE = [
    # workload, pinned, whether the idle train device 1 may be lent
    pytest.param(_fresh_step(), set(), True, id="step-start:idle-and-new-train-devices"),
    pytest.param(_fresh_step(), {1}, False, id="step-start:pinned-train-device-stays"),
    pytest.param(_fresh_step(judge_queued=2), set(), True, id="mid-step-with-sequences-waiting"),
    pytest.param(_fresh_step(rollout_queued=0), set(), False, id="nothing-queued:idle-train-device-stays"),
]


@pytest.mark.parametrize(("workload", "pinned", "idle"), LENDABLE)
def test_the_devices_a_plan_has_in_train_that_could_generate_instead(workload, pinned, idle):
    # device 0 leaves train as planned, 1 stays there idle, 2 is planned to leave the rollout for train,
    # 4 to leave the judge for train, 3 gets its first role (train)
    p = profiles(shift=0.05)
    current = {0: T, 1: T, 2: R, 3: None, 4: G}
    planned = [(0, T, R), (2, R, T), (3, None, T), (4, G, T)]
    lent = lendable(planned, current, pinned, summarize(workload, p).rollout)
    # as moves: 2 and 4 stay where they are, 3 starts on the rollout, 1 joins it
    assert lent == [(2, R, R), (3, None, R), (4, G, G), *([(1, T, R)] if idle else [])]
    moves, wait = lend(planned, lent, needed=10.0, costs=p.costs)
    assert wait == pytest.approx(10.0 - 0.05)  # then a device must leave for train to be in time
    assert moves == sorted([(0, T, R), (3, None, R), *([(1, T, R)] if idle else [])])


def test_nothing_to_lend_once_the_rollout_is_done():
    p = profiles(shift=0.05)
    done = summarize(_fresh_step(rollout_remaining=[], rollout_groups=[], rollout_queued=0), p).rollout
    assert lendable([(2, R, T), (3, None, T)], {0: T, 1: T, 2: R, 3: None}, set(), done) == []


def test_no_loan_when_devices_are_needed_in_train_soon():
    p = profiles(shift=0.05)
    planned = [(0, T, R), (2, R, T)]
    assert lend(planned, [(2, R, R)], needed=0.2, costs=p.costs) == (planned, math.inf)
    assert lend(planned, [], needed=10.0, costs=p.costs) == (planned, math.inf)


@pytest.mark.parametrize(("judging", "tokens", "first", "later"), [(1, 8000, 0.5, True), (6, 20_000, 3.0, False)])
def test_train_devices_are_needed_at_the_latest_arrival_that_keeps_the_estimate(judging, tokens, first, later):
    """Mid-step: one group still generating, ``judging`` generated whole and waiting for their judgments
    (judged ahead of the 96 queued: the first group trainable once its 4, or the 6 groups' 24, are done,
    at 8 judgments a second), the rest later. A device moved to train now is needed by the latest
    arrival that keeps the estimate: later than the first group when one small group comes first, as
    soon as it comes when there is much to train."""
    p = profiles(shift=0.05)
    w = summarize(Workload(rollout_remaining=[500] * 4, rollout_groups=[9] * 4, judge_future=4, judge_queued=96,
                            judge_tokens_mean=50, train_groups_left=8, train_groups_judging=judging,
                            train_tokens_per_group=tokens, train_group_size=4), p)  # fmt: skip
    model = PhaseModel(w, p, MAX_BATCH)
    c = candidate((2, 1, 1), (3, 1, 0), 0, {R: 3, G: 1, T: 0}, model)  # one device R -> T
    needed = train_needed(c, 1, model)
    assert c.est.train_from == pytest.approx(first)
    assert (needed > c.est.train_from + 10) if later else needed == pytest.approx(c.est.train_from)

    def total(at: float) -> float:
        return model.estimate(c.alloc, ((0, 0.0), (0, 0.0), (1, at))).total

    assert total(needed) == pytest.approx(c.est.total, rel=1e-5)
    assert total(needed + 1.0) > c.est.total + 0.1
