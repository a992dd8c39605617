"""The one drive loop (pivotrl.control.drive): commands out, a batch of events back, the caller's hook between."""

from __future__ import annotations

import pytest

from pivotrl.control.drive import Driver, StallError, drive
from pivotrl.control.messages import Abort, Command, Event, Role, ShiftDone


class Script:
    """A controller stand-in: each batch of events it is handed answers with the next round of commands."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.handled, self.done = rounds, [], False

    def start(self) -> list[Command]:
        return [Abort(0, (1,))]

    def handle_all(self, events: list[Event]) -> list[Command]:
        self.handled.append(events)
        self.done = len(self.handled) >= self.rounds
        return [Abort(0, (len(self.handled) + 1,))]


class Echo:
    """A driver that answers each command with one event, all of a round together."""

    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.pending: list[Event] = []

    def submit(self, cmd: Command) -> None:
        self.sent.append(cmd)
        self.pending.append(ShiftDone(0, Role.ROLLOUT, 0, 0.0, 0))

    def next_events(self) -> list[Event]:
        if not self.pending:
            raise StallError("the controller waits for events but no device has work")
        out, self.pending = self.pending, []
        return out

    def slices(self) -> list:
        return []

    def close(self) -> None:
        pass


def test_the_loop_runs_until_done_with_the_hook_after_every_batch():
    ctl, driver, seen, after = Script(rounds=3), Echo(), [], []
    stats = drive(ctl, driver, lambda: after.append(len(ctl.handled)), seen.append)  # type: ignore[arg-type]
    assert [c.uids for c in driver.sent] == [(1,), (2,), (3,)]  # (the last round is not sent: the job is done)
    assert seen == driver.sent
    assert after == [1, 2, 3] and len(ctl.handled) == 3
    assert stats.events == 3 and stats.driver_s >= 0 and stats.control_s >= 0


def test_a_driver_with_nothing_to_report_stalls_the_loop_loudly():
    class Idle(Echo):
        def submit(self, cmd: Command) -> None:
            self.sent.append(cmd)

    with pytest.raises(StallError, match="no device has work"):
        drive(Script(rounds=2), Idle(), lambda: None)  # type: ignore[arg-type]


def test_every_driver_implements_the_protocol():
    from pivotrl.runtime.local import LocalDriver
    from pivotrl.runtime.ray_driver import RayDriver
    from pivotrl.sim.driver import SimDriver

    for cls in (LocalDriver, RayDriver, SimDriver, Echo):
        for name in ("submit", "next_events", "slices", "close"):
            assert callable(getattr(cls, name, None)), (cls.__name__, name)
    assert Driver.__name__ == "Driver"
