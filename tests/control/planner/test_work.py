"""The work summary: a workload reduced to one record per phase, and the rollout's grid of expected ends."""

from __future__ import annotations

import math

import pytest

from pivotrl.control.planner import LengthModel, Workload, summarize
from pivotrl.control.planner.work import GRID, RolloutGrid, fits, longest_judgment, rollout_grid
from tests.control.planner.cases import judgments, profiles


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


def test_a_workload_is_summed_up_in_one_record_per_phase():
    p = profiles()
    w = Workload(rollout_remaining=[0] * 4 + [100] * 2, rollout_queued=4, rollout_holders=1, judge_queued=3,
                 judge_running=1, judge_holders=1, judge_future=6, judge_tokens_mean=50, train_groups_left=4,
                 train_groups_ready=1, train_groups_judging=5, train_group_size=4, step_seconds=2.0,
                 lockstep_train=True, train_devices_needed=2)  # fmt: skip
    s = summarize(w, p)
    r, j, t = s.rollout, s.judge, s.train
    assert (r.seqs, r.queued, r.holders) == (6, 4, 1)
    expected = 4 * p.lengths.expected_remaining(0) + 2 * p.lengths.expected_remaining(100)
    assert r.tokens == pytest.approx(expected)
    assert r.grid.points and not r.grid.grouped  # sequences left, groups not named
    assert (j.items, j.queued, j.running, j.holders, j.future, j.tokens) == (9, 3, 1, 1, 6, 50)
    assert j.left_running == 50  # a whole judgment for the running one, none said otherwise
    assert j.fits == math.inf and j.kv is None  # no paged cache: its slots are the only limit
    # groups waiting for judgments are at most those not ready to train
    assert (t.groups, t.ready, t.judging, t.group_size, t.needed, t.lockstep) == (4, 1, 3, 4, 2, True)
    assert t.step_seconds == 2.0


def test_nothing_left_sums_up_to_nothing():
    s = summarize(Workload(), profiles())
    assert (s.rollout.seqs, s.rollout.tokens, s.rollout.grid) == (0, 0.0, RolloutGrid())
    assert (s.judge.items, s.judge.longest_running, s.train.groups) == (0, 0.0, 0)


def test_a_paged_judge_cache_holds_the_judgments_left_at_their_context():
    # 8 judgments waiting, each reading 950 tokens and writing 100 (half of it held on average): 1,000 a judgment
    w = Workload(judge_queued=8, judge_tokens_mean=100, judge_read_tokens=8 * 950.0)
    s = summarize(w, profiles(), judge_kv=16_000)
    assert s.judge.left_context == pytest.approx(1000.0) and s.judge.wait_context == pytest.approx(1000.0)
    assert s.judge.fits == 16 and s.judge.kv == 16_000


def test_a_judge_device_holds_its_slots_or_what_its_cache_fits_and_one_at_least():
    assert fits(None, 1000.0, slots=32) == 32
    assert fits(16_000, 1000.0, slots=32) == 16
    assert fits(1_000_000, 1000.0, slots=32) == 32
    assert fits(100, 1000.0, slots=32) == 1.0  # a judgment longer than the cache still runs


def test_the_longest_judgment_is_the_mean_until_enough_are_seen():
    assert longest_judgment(LengthModel(min_samples=4), {0: 100}, mean=129.0) == 129.0
    tailed = judgments(True)
    assert longest_judgment(tailed, {0: 100}, mean=129.0) == tailed.expected_longest({0: 100}) > 1000


def test_the_grid_spans_the_longest_sequences_expected_rest():
    lm = LengthModel(min_samples=4)
    for n in range(100, 1001, 100):
        lm.observe(n)
    points = rollout_grid(Workload(rollout_remaining=[0] * 4, prompt_tokens_mean=50), lm, 800.0).points
    assert [p.at for p in points] == pytest.approx([800.0 * (k + 1) / GRID for k in range(GRID)])
    assert all(p.context >= 50 for p in points)  # the prompt and the tokens so far
    assert rollout_grid(Workload(rollout_remaining=[10]), lm, 0.0) == RolloutGrid()  # nothing expected to come
