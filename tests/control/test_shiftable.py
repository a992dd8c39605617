"""Shiftable mode's policy: it plans from the controller's view, and re-plans only when
something a plan reacts to changed or its estimate is due for a refresh."""

import pytest

from pivotrl.control.messages import Judged, JudgeResult, Progress, Role
from pivotrl.control.modes import Demand
from pivotrl.control.planner import Workload
from pivotrl.control.shiftable import REPLAN_SHARE, PlanView, Shiftable

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN


class Counting:
    def __init__(self, workload: Workload) -> None:
        self.workload, self.calls = workload, 0

    def __call__(self) -> Workload:
        self.calls += 1
        return self.workload


def demand(now: float, make: Counting, loads=(4, 4, 0, 0), roles=(R, R, G, T), gen: int = 8) -> Demand:
    return Demand(gen, 8, False, False, loads, PlanView(now, (roles, frozenset()), make))


def test_replans_only_on_change_or_when_due():
    policy = Shiftable(4, max_batch=64, rollout_tokens=96, judge_tokens=48)
    make = Counting(Workload(rollout_remaining=[3] * 8, judge_future=8, judge_queued=8, judge_tokens_mean=40))
    first = policy.targets(demand(0.0, make))
    assert make.calls == 1 and set(first) == {0, 1, 2, 3}
    assert policy.targets(demand(1e-4, make)) == first and make.calls == 1  # same situation, not due: no work built
    policy.targets(demand(1e-4, make, loads=(4, 0, 0, 0)))  # a device ran dry: plan again
    assert make.calls == 2
    due = policy._last[2]
    assert 0 < due <= REPLAN_SHARE * 1e3
    policy.targets(demand(due + 1e-6, make, loads=(4, 0, 0, 0)))  # the estimate is due for a refresh
    assert make.calls == 3


def test_a_view_built_from_a_workload_needs_no_callable():
    w = Workload(judge_queued=3)
    assert PlanView(0.0, ((R,), frozenset()), w).workload is w


def test_a_view_builds_its_layout_on_first_use_only():
    calls = []

    def layout():
        calls.append(1)
        return (R, G), frozenset({1})

    view = PlanView(0.0, layout, Workload())
    assert calls == []  # a policy answering from its last plan never asks
    assert view.roles == (R, G) and view.pinned == frozenset({1}) and len(calls) == 1


def test_slices_teach_each_role_its_own_speeds():
    policy = Shiftable(4, max_batch=64, rollout_tokens=96, judge_tokens=48)
    p = policy.profiles
    judge_prefill = p.judge.prefill_rate
    # a slice that only prefilled (a migrated batch resuming) still says how fast prompts are read
    policy.observe(Progress(0, Role.ROLLOUT, 0.5, 8, 8, prefill_tokens=4000, prefill_seconds=0.5, steps=0), None)
    assert p.rollout.prefill_rate > 5000.0 and p.rollout.samples == 0
    # decode time is the slice less its prefill, per decode step; the judge's profile is left alone
    policy.observe(Progress(1, Role.ROLLOUT, 1.0, 100, 10, prefill_tokens=0, prefill_seconds=0.0, steps=10), None)
    assert p.rollout.samples == 1 and p.judge.samples == 0 and p.judge.prefill_rate == judge_prefill
    # a runtime that counts what its decode steps read tells the profile their context: 100 tokens
    # read 3,000 tokens of KV cache, 30 each
    policy.observe(Progress(1, Role.ROLLOUT, 1.0, 100, 10, steps=10, kv_tokens=3000), None)
    assert p.rollout.context == pytest.approx(30.0) and p.judge.context == 0.0


def test_finished_judgments_teach_the_planner_how_their_lengths_spread():
    policy = Shiftable(4, max_batch=64, rollout_tokens=96, judge_tokens=48)
    lengths = policy.profiles.judgments
    assert (lengths.samples, lengths.prior_max) == (0, 48.0)
    policy.observe(Judged(2, tuple(JudgeResult(uid, "VERDICT: yes", False, 4 + uid) for uid in range(40))), None)
    assert lengths.samples == 40 and lengths.expected_longest({0: 40}) > lengths.mean


def test_a_plan_that_lends_devices_is_planned_again_when_they_are_due():
    policy = Shiftable(4, max_batch=64, rollout_tokens=96, judge_tokens=48)
    make = Counting(Workload(rollout_remaining=[3] * 8, judge_future=8, judge_queued=8, judge_tokens_mean=40))
    plan = policy.planner.plan

    def lending(*args, **kwargs):
        decision = plan(*args, **kwargs)
        decision.wake = decision.now + 1e-3  # train devices lent to the rollout, due back this soon
        return decision

    policy.planner.plan = lending
    policy.targets(demand(0.0, make))
    assert policy._last[2] == 1e-3
    policy.targets(demand(1e-3 + 1e-6, make))  # nothing else changed
    assert make.calls == 2
