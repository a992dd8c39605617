"""The plan's memo: each answer computed once per key, kept apart by role and by kind."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pivotrl.control.planner import PhaseModel, summarize
from pivotrl.control.planner.memo import PlanMemo
from tests.control.planner.cases import EARLY, MAX_BATCH, TAIL, G, R, profiles


def counting(value: float) -> tuple[list[int], Callable[[], float]]:
    calls: list[int] = []

    def compute() -> float:
        calls.append(1)
        return value

    return calls, compute


def test_each_answer_is_computed_once_per_key():
    memo = PlanMemo()
    calls, compute = counting(2.5)
    assert memo.rate(R, 4, compute) == 2.5
    assert memo.rate(R, 4, compute) == 2.5
    assert len(calls) == 1
    assert memo.rate(R, 5, compute) == 2.5 and len(calls) == 2  # another device count: another answer


def test_roles_and_kinds_of_answer_do_not_share_keys():
    memo = PlanMemo()
    memo.rate(R, 4, lambda: 1.0)
    assert memo.rate(G, 4, lambda: 2.0) == 2.0  # the judge's rate on 4 devices is not the rollout's
    assert memo.slowdown(4, lambda: 3.0) == 3.0
    assert memo.longest(4, lambda: 4.0) == 4.0
    assert memo.tail_steps(4, lambda: [5.0]) == [5.0]
    assert (memo.rate(R, 4, lambda: 0.0), memo.slowdown(4, lambda: 0.0), memo.longest(4, lambda: 0.0)) == (1, 3, 4)


@pytest.mark.parametrize("workload", [TAIL, EARLY], ids=["tail", "early"])
def test_a_plans_memo_answers_every_allocation_as_a_fresh_model_would(workload):
    """A plan's allocations share the memo: each estimate is the one a model with an empty memo gives."""
    p = profiles()
    shared = PhaseModel(summarize(workload, p), p, MAX_BATCH)
    for alloc in [(3, 1, 0), (1, 2, 1), (2, 2, 0), (3, 1, 0), (0, 4, 0)]:
        fresh = PhaseModel(summarize(workload, p), p, MAX_BATCH)
        assert shared.estimate(alloc) == fresh.estimate(alloc)
