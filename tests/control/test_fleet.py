"""The fleet of device views, alone: targets turned into shifts and aborts, and each state's transitions."""

from __future__ import annotations

import pytest

from pivotrl.control.fleet import DeviceState, Fleet
from pivotrl.control.messages import Abort, Accumulate, Role, Shift, ShiftDone, Step

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN
S = DeviceState


def in_roles(roles: list[Role], version: int = 0) -> Fleet:
    """A fleet whose devices hold ``roles`` at ``version``, each ready."""
    fleet = Fleet(len(roles))
    targets = dict(enumerate(roles))
    shifts = fleet.steer(targets, (0,) * len(roles), version, preempt=False)
    assert shifts == [Shift(i, r, version) for i, r in enumerate(roles)]
    assert [d.state for d in fleet.devices] == [S.SHIFTING] * len(roles)
    assert fleet.layout() == (tuple(roles), frozenset(range(len(roles))))  # on its way: seen in its new role
    for i, r in enumerate(roles):
        fleet.shifted(ShiftDone(i, r, version, 0.1, 0))
    fleet.touch(range(len(roles)))
    assert fleet.steer(targets, (0,) * len(roles), version, preempt=False) == []
    return fleet


def test_devices_shift_to_their_targets_then_take_their_roles_work():
    fleet = in_roles([R, R, G, T])
    assert [d.state for d in fleet.devices] == [S.READY] * 4 and fleet.layout() == ((R, R, G, T), frozenset())
    assert fleet.holders(R) == [0, 1] and fleet.ready(R) == [0, 1] and fleet.ready(G) == [2]
    assert fleet.wanted == {R: 2, G: 1, T: 1}
    assert fleet.role_load(R, (3, 4, 5, 0)) == 7 and fleet.role_load(G, (3, 4, 5, 0)) == 5


def test_a_new_version_makes_rollout_and_train_devices_stale_not_the_judge():
    fleet = in_roles([R, G, T])
    assert fleet.steer({0: R, 1: G, 2: T}, (0, 0, 0), 1, preempt=False) == [Shift(0, R, 1), Shift(2, T, 1)]
    fleet = in_roles([R, G])
    # a stale rollout device with work finishes it and takes no more
    assert fleet.steer({0: R, 1: G}, (2, 0), 1, preempt=False) == [] and fleet.ready(R) == []


@pytest.mark.parametrize("preempt", [True, False])
def test_a_device_leaving_its_role_with_work_aborts_it_only_where_the_policy_preempts(preempt):
    fleet = in_roles([R, R, G])
    cmds = fleet.steer({0: G, 1: R, 2: G}, (3, 3, 0), 0, preempt=preempt)
    if not preempt:  # it stays in its role while it has work (and may take more), shifting once it has none
        assert cmds == [] and fleet.ready(R) == [0, 1] and fleet[0].state is S.READY
        fleet.touch([0])
        assert fleet.steer({0: G, 1: R, 2: G}, (0, 3, 0), 0, preempt=False) == [Shift(0, G, 0)]
        return
    assert cmds == [Abort(0)] and fleet[0].state is S.ABORTING and fleet[0].leaving is G
    assert fleet.layout() == ((G, R, G), frozenset({0}))
    fleet.aborted(0)
    fleet.touch([0])
    # the decision acted on is kept: it shifts where it was leaving for, whatever the targets say by then
    assert fleet.steer({0: G, 1: R, 2: G}, (0, 3, 0), 0, preempt=True) == [Shift(0, G, 0)]
    assert fleet[0].heading is G and fleet[0].leaving is None


def test_only_devices_touched_since_are_looked_at_again_under_the_same_targets():
    fleet = in_roles([R, G])
    targets = {0: R, 1: G}
    fleet.shifted(ShiftDone(1, R, 0, 0.1, 0))  # (untouched: not looked at)
    assert fleet.steer(targets, (0, 0), 0, preempt=False) == []
    fleet.touch([1])
    assert fleet.steer(targets, (0, 0), 0, preempt=False) == [Shift(1, G, 0)]
    fleet.shifted(ShiftDone(1, R, 0, 0.1, 0))
    fleet.look_again()  # every device, as if the targets had changed
    assert fleet.steer(targets, (0, 0), 0, preempt=False) == [Shift(1, G, 0)]
    fleet.touch_commands([Step((0,), 0, 1), Accumulate(1, 0, None)])  # type: ignore[arg-type]
    fleet.shifted(ShiftDone(1, R, 0, 0.1, 0))
    assert fleet.steer(targets, (0, 0), 0, preempt=False) == [Shift(1, G, 0)]


def test_a_train_device_holds_its_gradients_until_the_optimizer_step():
    fleet = in_roles([R, T, T])
    fleet.accumulate(1, [0, 1])
    assert fleet[1].state is S.ACCUMULATING and fleet[1].in_backward == 2 and fleet[1].held == [0, 1]
    fleet.accumulated(1)
    assert fleet[1].state is S.HOLDING and fleet[1].in_backward == 0
    fleet.accumulate(1, [2])
    fleet.accumulated(1)
    assert fleet[1].held == [0, 1, 2]
    fleet.touch([1])
    assert fleet.steer({0: R, 1: R, 2: T}, (0, 0, 0), 0, preempt=True) == []  # pinned: no shift
    assert fleet.layout()[1] == frozenset({1})
    fleet.step((1, 2))
    assert [d.state for d in fleet.devices] == [S.READY, S.STEPPING, S.STEPPING]
    fleet.stepped((1, 2), version=1, shard=True)
    assert [(d.state, d.version, d.shard, d.held) for d in fleet.devices[1:]] == [(S.READY, 1, True, [])] * 2
    fleet.shifted(ShiftDone(2, R, 1, 0.1, 0))
    assert not fleet[2].shard  # its shard went to the GPS with the shift


def test_a_failed_optimizer_step_leaves_its_devices_stale():
    fleet = in_roles([T, T])
    fleet.accumulate(0, [0])
    fleet.accumulated(0)
    fleet.step((0, 1))
    fleet.step_failed((0, 1))
    assert [(d.state, d.version, d.held) for d in fleet.devices] == [(S.READY, -1, [])] * 2
    fleet.touch([0, 1])
    assert fleet.steer({0: T, 1: T}, (0, 0), 0, preempt=False) == [Shift(0, T, 0), Shift(1, T, 0)]


def test_a_lost_device_holds_no_role_until_it_joins_again():
    fleet = in_roles([R, R, T])
    fleet.accumulate(2, [4])
    old = fleet.lose(2)
    assert old.held == [4] and old.state is S.ACCUMULATING  # the view as it was
    assert fleet[2].lost and fleet[2].role is None and fleet.holders(T) == [] and fleet.alive(range(3)) == (0, 1)
    assert fleet.layout() == ((R, R, None), frozenset({2}))
    assert fleet.steer({0: R, 1: R, 2: T}, (0, 0, 0), 0, preempt=False) == []
    assert fleet.wanted == {R: 2}  # a lost device counts in no role
    fleet.join(2)
    assert fleet.steer({0: R, 1: R, 2: T}, (0, 0, 0), 0, preempt=False) == [Shift(2, T, 0)]
