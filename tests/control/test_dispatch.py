"""Queued requests to ready devices, and the rollout rebalanced, alone (a scheduler and a fleet, no loop)."""

from __future__ import annotations

import pytest

from pivotrl.control.dispatch import RequestDispatch
from pivotrl.control.fleet import DeviceState, Fleet
from pivotrl.control.messages import Abort, Generate, GenParams, GenRequest, Judge, JudgeRequest, Role, ShiftDone
from pivotrl.control.scheduler import Scheduler

R, G = Role.ROLLOUT, Role.JUDGE


def ready_fleet(roles: list[Role]) -> Fleet:
    fleet = Fleet(len(roles))
    targets = dict(enumerate(roles))
    fleet.steer(targets, (0,) * len(roles), 0, preempt=False)
    for i, r in enumerate(roles):
        fleet.shifted(ShiftDone(i, r, 0, 0.1, 0))
    fleet.touch(range(len(roles)))
    fleet.steer(targets, (0,) * len(roles), 0, preempt=False)
    return fleet


def test_queued_requests_go_to_the_ready_devices_of_their_role():
    scheduler, fleet = Scheduler(per_device=2), ready_fleet([R, R, G])
    scheduler.submit_gen([GenRequest(u, "p", u, GenParams(8)) for u in range(4)])
    scheduler.submit_judge([JudgeRequest(u, "q", "r", "x", u, GenParams(8)) for u in (10, 11)])
    cmds = RequestDispatch(rebalance=True).dispatch(scheduler, fleet, 0, {})
    gens = {c.device: [r.uid for r in c.requests] for c in cmds if isinstance(c, Generate)}
    assert sorted(u for uids in gens.values() for u in uids) == [0, 1, 2, 3] and set(gens) == {0, 1}
    assert [(c.device, [r.uid for r in c.requests]) for c in cmds if isinstance(c, Judge)] == [(2, [10, 11])]
    assert not scheduler.gen_queue and not scheduler.judge_queue


@pytest.mark.parametrize("rebalance", [True, False])
def test_once_the_rollout_queue_is_empty_the_busiest_device_hands_work_to_an_idle_one(rebalance):
    scheduler, fleet = Scheduler(per_device=8), ready_fleet([R, R])
    scheduler.submit_gen([GenRequest(u, "p", u, GenParams(8)) for u in range(4)])
    requests = RequestDispatch(rebalance)
    scheduler.dispatch_gen([0], 0)  # every request on device 0
    requests.changed()
    cmds = requests.dispatch(scheduler, fleet, 0, {u: 10 * u for u in range(4)})
    if not rebalance:
        assert cmds == []
        return
    assert cmds == [Abort(0, (0, 1))]  # half, those with the fewest tokens to re-prefill
    assert fleet[0].state is DeviceState.ABORTING and not requests.due
    assert requests.dispatch(scheduler, fleet, 0, {}) == []  # not due again until loads change
