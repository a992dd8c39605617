"""In-process driver: the devices are ``Worker`` objects in this process.

Used for a one-device job (no Ray start-up) and in tests of the control
plane with real models. Work is interleaved by time slices, so streaming and
shifts behave as they do on the Ray driver; a data-parallel update needs
separate processes and is refused here.
"""

from __future__ import annotations

from pivotrl.control.drive import StallError
from pivotrl.control.messages import Abort, Accumulate, Command, Event, Generate, Judge, Shift, Step
from pivotrl.resolve import Plan
from pivotrl.runtime.groups import TrainGroups
from pivotrl.runtime.worker import Worker
from pivotrl.telemetry import Slice

SLICE_SECONDS = 0.05  # generation time between two looks at the control plane


class LocalDriver:
    def __init__(self, workers: list[Worker], slice_seconds: float | None = None) -> None:
        self.workers = workers
        self.slice_seconds = SLICE_SECONDS if slice_seconds is None else slice_seconds
        self.events: list[Event] = []
        self.groups = TrainGroups()

    def configure(self, plan: Plan) -> None:
        """Every device's train config, dtypes and backends, as the job resolved them once the devices were known."""
        for w in self.workers:
            w.configure(plan)

    def submit(self, cmd: Command) -> None:
        if isinstance(cmd, Shift):
            self.events.append(self.workers[cmd.device].shift(cmd.role, cmd.version))
        elif isinstance(cmd, Generate):
            self.workers[cmd.device].generate(cmd)
        elif isinstance(cmd, Judge):
            self.workers[cmd.device].judge(cmd)
        elif isinstance(cmd, Accumulate):
            self.events.append(self.workers[cmd.device].accumulate(cmd))
        elif isinstance(cmd, Step):
            if len(cmd.devices) != 1:
                raise ValueError("the in-process driver steps on one device; use the Ray driver for more")
            worker = self.workers[cmd.devices[0]]
            rendezvous, _ = self.groups.plan(cmd.devices, lambda d: self.workers[d].retire_group(), None)
            event = worker.step(cmd, 0, rendezvous, self.groups.state_world)
            self.groups.stepped(cmd.devices)
            assert event is not None
            self.events.append(event)
        elif isinstance(cmd, Abort):
            self.events.append(self.workers[cmd.device].abort(cmd.uids))
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def next_events(self) -> list[Event]:
        if not self.events:
            busy = [w for w in self.workers if w.has_work]
            if not busy:
                raise StallError("the controller waits for events but no device has work")
            for w in busy:
                self.events += w.run(self.slice_seconds)
        out, self.events = self.events, []
        return out

    def start_clock(self, origin: float) -> None:
        for w in self.workers:
            w.origin = origin

    def slices(self) -> list[Slice]:
        return [s for w in self.workers for s in w.drain_slices()]

    def close(self) -> None:
        for w in self.workers:
            w.close()
