"""Train dispatch, alone: judged samples to the train devices in shares, the optimizer step when all are in."""

from __future__ import annotations

import pytest

from pivotrl.control.book import StepBook
from pivotrl.control.fleet import DeviceState, Fleet
from pivotrl.control.messages import Accumulate, GenResult, JudgeResult, Role, ShiftDone, Step
from pivotrl.control.spec import DeviceLostError
from pivotrl.control.training import UPDATE_ATTEMPTS, TrainDispatch, train_needed
from tests.control.test_book import JUDGE, TRAIN_SET, spec

R, T = Role.ROLLOUT, Role.TRAIN


def judged_book(**overrides) -> StepBook:
    """A step (3 groups of 2) whose every sample is generated (1 response token) and judged."""
    book, _ = StepBook.draw(spec(**overrides), 1, 0, TRAIN_SET, 0.0)
    for uid in range(6):
        book.generated(GenResult(uid, [1] * 3, [5], [-0.5], "x", "stop", 0), now=0.0)
        r = JudgeResult(uid, "VERDICT: yes" if uid % 2 else "VERDICT: no", False, 5)
        book.judged(r, JUDGE.score(r.text, truncated=False), now=0.0)
    return book


def fleet_of(roles: list[Role]) -> Fleet:
    fleet = Fleet(len(roles))
    fleet.steer(dict(enumerate(roles)), (0,) * len(roles), 0, preempt=False)
    for i, r in enumerate(roles):
        fleet.shifted(ShiftDone(i, r, 0, 0.1, 0))
    return fleet


def test_judged_samples_go_out_in_shares_then_the_step_runs_on_every_train_device():
    book, fleet, now = judged_book(checkpoint_every=1), fleet_of([R, T, T]), [7.0]
    train = TrainDispatch(checkpoint_every=1, last_step=2, clock=lambda: now[0])
    devices = lambda: (1, 2)  # noqa: E731
    cmds = train.dispatch(book, fleet, 0, devices, lambda: 2)
    # 24 tokens queued over 2 devices (12), but at most every device's share of the step (6 samples / 3 devices)
    assert [(c.device, len(c.shard.advantages)) for c in cmds if isinstance(c, Accumulate)] == [(1, 2), (2, 2)]
    assert book.record.train_start == 7.0 and [fleet[i].state for i in (1, 2)] == [DeviceState.ACCUMULATING] * 2
    assert train.dispatch(book, fleet, 0, devices, lambda: 2) == []  # both busy
    fleet.accumulated(1)
    book.record.accumulated += 2
    now[0] = 8.0
    # device 1 holds gradients and is free: the 8 tokens left in shares of 4 (1 sample) over the 2 train devices
    assert [(c.device, len(c.shard.advantages)) for c in train.dispatch(book, fleet, 0, devices, lambda: 2)] == [(1, 1)]
    fleet.accumulated(1)
    assert [c.device for c in train.dispatch(book, fleet, 0, devices, lambda: 2)] == [1]
    fleet.accumulated(1)
    fleet.accumulated(2)
    book.record.accumulated += 4
    assert book.record.train_start == 7.0 and not book.queue
    [step] = train.dispatch(book, fleet, 0, devices, lambda: 2)
    assert step == Step((1, 2), 0, 6, checkpoint=True) and train.stepping and not train.ready
    assert [fleet[i].state for i in (1, 2)] == [DeviceState.STEPPING] * 2
    assert train.dispatch(book, fleet, 0, devices, lambda: 2) == []  # (it runs)


def test_the_step_waits_for_the_train_devices_it_needs():
    book, fleet = judged_book(), fleet_of([R, T])
    book.queue.clear()
    book.record.accumulated = 6
    train = TrainDispatch(0, 2, lambda: 0.0)
    assert train.dispatch(book, fleet, 0, lambda: (1,), lambda: 2) == []
    assert train.dispatch(book, fleet, 0, lambda: (0, 1), lambda: 2) == []  # device 0 is not in the train role
    [step] = train.dispatch(book, fleet, 0, lambda: (1,), lambda: 1)
    assert step == Step((1,), 0, 6, checkpoint=False)


def test_how_many_train_devices_the_step_waits_for():
    fleet = fleet_of([R, T, T, T])
    assert train_needed(fleet, False, lambda: (1, 2, 3), 2) == 2
    fleet.lose(3)
    fleet.lose(2)
    assert train_needed(fleet, False, lambda: (1, 2, 3), 2) == 1  # nothing brings a static layout's lost ones back
    assert train_needed(fleet, True, lambda: (1,), 2) == 2  # a planning policy brings any device not lost


def test_a_failed_update_is_retried_a_few_times_then_stops_the_attempt():
    train = TrainDispatch(0, 2, lambda: 0.0)
    for _ in range(UPDATE_ATTEMPTS - 1):
        train.stepping = True
        train.update_failed(1, "device 9 died")
        assert not train.stepping and train.ready
    with pytest.raises(DeviceLostError, match=f"step 1 failed {UPDATE_ATTEMPTS} times in a row \\(last: gone\\)"):
        train.update_failed(1, "gone")
    train.trained()
    assert train.failed == 0 and not train.stepping
