"""The work summary: a workload reduced to one record per phase, and the rollout's grid of expected ends."""

from __future__ import annotations

import pytest

from pivotrl.control.planner import (
    LengthModel,
    Workload,
    summarize,
)
from pivotrl.control.planner.work import RolloutGrid, rollout_grid
from tests.control.planner.cases import (
    profiles,
)


@pytest.mark.parametrize(
    "kwargs",
    [{"judge_queued": 4, "judge_running": 5}, {"judge_read_tokens": 10.0, "judge_read_running": 11.0}],
    ids=["more-running-than-queued", "more-read-running-than-queued"],
)
def test_workload_running_judgments_are_some_of_the_queued(kwargs):
    with pytest.raises(ValueError, match="judge_running"):
        Workload(**kwargs)


def test_rollout_grid_expects_groups_whole_as_their_members_end():
    # lengths 100..1000 seen; group 0 has one member at 950 tokens (it ends within 50 more), group 1
    # one just started (any length): group 0 is whole early, group 1 only by the end of the grid
    lm = LengthModel(min_samples=4)
    for n in range(100, 1001, 100):
        lm.observe(n)
    w = Workload(rollout_remaining=[950, 0], rollout_groups=[0, 1], judge_future=2)
    grid = rollout_grid(w, lm, longest=1000.0)
    points = grid.points
    assert grid.grouped and len(points) == 8 and points[-1].at == 1000.0
    assert points[0].whole == pytest.approx(1.1)  # group 0 surely, group 1 if it is 100 tokens long (1 in 10)
    assert points[-1].whole == pytest.approx(2.0)
    ended = [point.ended for point in points]
    assert ended == sorted(ended) and points[0].alive > points[-1].alive
    blind = rollout_grid(Workload(rollout_remaining=[950, 0]), lm, 1000.0)  # groups unknown: no group ends
    assert not blind.grouped and len(blind.points) == 8
    assert all(point.ended == point.whole == 0.0 for point in blind.points)
    assert rollout_grid(Workload(), lm, 1000.0) == RolloutGrid()  # nothing left


def test_workload_groups_must_match_the_sequences():
    with pytest.raises(ValueError, match="rollout_groups"):
        Workload(rollout_remaining=[1, 2, 3], rollout_groups=[0, 1])


def test_responses_still_generating_train_at_the_length_they_are_expected_to_reach():
    # 16 responses of 2 groups at 500 tokens each, the length model expecting 1000 (500 more) or 3000; two
    # finished responses of 100 tokens counted by the controller; held-out answers (group -1) train nothing
    p = profiles()
    for expect in (1000, 3000):
        p.lengths = LengthModel(min_samples=4)
        for _ in range(100):
            p.lengths.observe(expect)
        groups = [0] * 8 + [1] * 8 + [-1] * 4
        w = Workload(rollout_remaining=[500] * 16 + [10] * 4, rollout_groups=groups, train_groups_left=2,
                     train_group_size=9, train_tokens_per_group=8 * 500 + 100)  # fmt: skip
        assert summarize(w, p).train.group_tokens == pytest.approx(8 * 500 + 100 + 8 * (expect - 500))
