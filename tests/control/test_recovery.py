"""Recovery of lost devices, alone: what ends the attempt, and what a lost device's work becomes."""

from __future__ import annotations

import pytest

from pivotrl.control.fleet import DeviceState, DeviceView
from pivotrl.control.messages import GenParams, GenRequest, JudgeRequest, Role
from pivotrl.control.recovery import Recovery
from pivotrl.control.scheduler import Scheduler
from pivotrl.control.spec import DeviceLostError

PARAMS = GenParams(8)


def gen(uid: int) -> GenRequest:
    return GenRequest(uid, f"prompt {uid}", uid, PARAMS)


def judge(uid: int) -> JudgeRequest:
    return JudgeRequest(uid, "q", "r", f"response {uid}", uid, PARAMS)


@pytest.mark.parametrize(
    ("view", "sharded", "message"),
    [
        (DeviceView(2, Role.TRAIN, state=DeviceState.STEPPING), True, "device 2 \\(train\\) was lost in the optimizer "
         "step of step 4: died"),
        (DeviceView(2, Role.TRAIN, shard=True), True, "device 2 \\(train\\) was lost holding its shard"),
        (DeviceView(2, None, shard=True), False, "device 2 \\(no role\\) was lost holding its shard"),
    ],
)  # fmt: skip
def test_a_device_holding_what_nothing_else_holds_ends_the_attempt(view, sharded, message):
    with pytest.raises(DeviceLostError, match=message):
        Recovery(sharded).check(view, 4, "died")


def test_losing_a_device_that_holds_nothing_unique_costs_its_work_only():
    Recovery(sharded_train=False).check(DeviceView(2, Role.TRAIN, state=DeviceState.STEPPING), 4, "died")
    Recovery(sharded_train=True).check(DeviceView(2, Role.ROLLOUT), 4, "died")


def test_a_lost_devices_work_begins_again_from_the_start_of_its_role():
    recovery, scheduler = Recovery(sharded_train=False), Scheduler(per_device=4)
    scheduler.submit_gen([GenRequest(uid, "p", uid, PARAMS, output_ids=[1, 2]) for uid in (5, 3, 9)])
    scheduler.dispatch_gen([0], 0)  # every one on device 0, with tokens written
    scheduler.submit_judge([judge(4)])
    scheduler.dispatch_judge([1])
    scheduler.submit_judge([judge(7)])  # (queued)
    work = recovery.lost(DeviceView(0, Role.ROLLOUT), scheduler, gen, judge, 1.5, "died")
    assert work.gen == [gen(3), gen(5), gen(9)] and work.judge == [] and len(work) == 3
    assert scheduler.load(0) == 0 and [r.uid for r in scheduler.gen_queue] == [3, 5, 9]  # from the start
    assert [r.output_ids for r in scheduler.gen_queue] == [[], [], []]
    work = recovery.lost(DeviceView(1, Role.JUDGE), scheduler, gen, judge, 2.0, "hung")
    assert work.judge == [judge(4)] and [r.uid for r in scheduler.judge_queue] == [4, 7]
    train = DeviceView(2, Role.TRAIN, state=DeviceState.ACCUMULATING, held=[6, 7, 8], in_backward=1)
    work = recovery.lost(train, scheduler, gen, judge, 3.0, "died")
    assert (work.held, work.in_backward, len(work)) == ([6, 7, 8], 1, 3)  # its gradients are gone
    stepping = DeviceView(3, Role.TRAIN, state=DeviceState.STEPPING, held=[6])
    assert recovery.lost(stepping, scheduler, gen, judge, 4.0, "died").held == []  # the step is done again, or was
    assert recovery.log == [(1.5, 0, "died"), (2.0, 1, "hung"), (3.0, 2, "died"), (4.0, 3, "died")]
