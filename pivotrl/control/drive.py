"""The one loop that runs the control plane over a driver, and the protocol every driver implements.

    controller.start() -> commands -> driver.submit -> driver.next_events -> controller.handle_all -> ...

Three drivers implement :class:`Driver`: the in-process devices (``pivotrl.runtime.local``), one Ray actor
per device (``pivotrl.runtime.ray_driver``) and the simulator's modeled devices (``pivotrl.sim.driver``).
The loop is the same for all of them; what a run does between two batches of events (write the finished
steps' rows, a checkpoint at a step boundary) is the caller's ``after`` hook. Pure logic: no torch, no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pivotrl.control.messages import Command, Event

if TYPE_CHECKING:
    from pivotrl.control.controller import Controller
    from pivotrl.telemetry import Slice


class StallError(RuntimeError):
    """The controller waits for events but no device has work (or, simulated, it repeats commands without
    virtual time moving): a control-plane bug."""


class Driver(Protocol):
    """Runs the control plane's commands on devices and reports what they did."""

    def submit(self, cmd: Command) -> None:
        """Send one command to its device(s); what it leads to comes back from ``next_events``."""

    def next_events(self) -> list[Event]:
        """The next events, at least one (waiting for them, or advancing the virtual clock); ``StallError``
        where no device has work."""
        ...

    def slices(self) -> list[Slice]:
        """What each device did and when, for the run's trace and timeline."""
        ...

    def close(self) -> None:
        """Stop the devices (idempotent)."""


@dataclass(slots=True)
class DriveStats:
    """Where the loop's wall time went: in the driver (devices, or the simulator's models) and in the
    control plane, and how many events it handled."""

    events: int = 0
    driver_s: float = 0.0
    control_s: float = 0.0


def drive(
    ctl: Controller,
    driver: Driver,
    after: Callable[[], None],
    submitted: Callable[[Command], None] | None = None,
) -> DriveStats:
    """Run ``ctl`` over ``driver`` until the job is done. ``after`` runs after every batch of events (the
    controller's state at a step boundary is seen there); ``submitted`` sees each command as it is sent.

    A batch of events is handled together (completions at one instant, then one look at the state), so a
    driver that reports several at once gets one round of commands for them."""
    stats = DriveStats()
    commands = ctl.start()
    while not ctl.done:
        t0 = time.perf_counter()
        for c in commands:
            driver.submit(c)
            if submitted is not None:
                submitted(c)
        batch = driver.next_events()
        t1 = time.perf_counter()
        commands = ctl.handle_all(batch)
        t2 = time.perf_counter()
        stats.events += len(batch)
        stats.driver_s += t1 - t0
        stats.control_s += t2 - t1
        after()
    return stats
