"""Train dispatch: the backward of judged samples handed to the train devices as groups are judged, and the
optimizer step once every sample's backward is done on enough train devices.

    every reward of a group --> its samples' backward (Accumulate), while the rollout still runs
    every backward of the step, every train device free, enough of them --> the optimizer step (Step)
"""

from __future__ import annotations

from collections.abc import Callable

from pivotrl.control.book import StepBook
from pivotrl.control.fleet import ACCUMULATING, HOLDING, READY, Fleet
from pivotrl.control.messages import Accumulate, Command, Role, Step
from pivotrl.control.spec import DeviceLostError

# an optimizer step that fails this many times in a row stops this attempt at the run (the job then resumes from
# its newest checkpoint on devices started afresh): a step whose devices cannot meet must not be retried for ever
UPDATE_ATTEMPTS = 3


def train_needed(fleet: Fleet, plans: bool, train_devices: Callable[[], tuple[int, ...]], min_devices: int) -> int:
    """Train devices the optimizer step waits for: ``min_devices``, or as many as could still train if fewer:
    every device not lost where the policy plans (``plans``: it brings them), the static layout's train devices
    (``train_devices()``) not lost otherwise (nothing would bring another: waiting for one would stall the job)."""
    could = range(len(fleet)) if plans else train_devices()
    return min(min_devices, len(fleet.alive(could)))


class TrainDispatch:
    """Whether every reward of the step is in (``ready``) and whether the optimizer step runs (``stepping``), and
    the optimizer steps failed in a row (``failed``)."""

    def __init__(self, checkpoint_every: int, last_step: int, clock: Callable[[], float]) -> None:
        self.checkpoint_every, self.last_step, self.clock = checkpoint_every, last_step, clock
        self.ready = self.stepping = False
        self.failed = 0

    def dispatch(
        self,
        book: StepBook,
        fleet: Fleet,
        version: int,
        train_devices: Callable[[], tuple[int, ...]],
        needed: Callable[[], int],
        hold: bool = False,
    ) -> list[Command]:
        """Backward of judged samples on the train devices (``train_devices()``, less the lost) as they come in;
        the optimizer step once every sample of the step is in and at least ``needed()`` train devices are free,
        unless ``hold`` (the current version is still needed: its evaluation runs)."""
        if self.stepping:
            return []
        rec = book.record
        n = len(rec.samples)
        if not book.queue and rec.accumulated < n:  # nothing to hand out, the step not due
            return []
        train_devs = fleet.alive(train_devices())
        if not train_devs:
            return []
        cmds: list[Command] = []
        # devices already holding gradients first: they stay in the role until the optimizer step
        # anyway, while a device given its first samples is pinned there too, out of the planner's reach
        devices = fleet.devices
        usable = [
            i for i in train_devs
            if (d := devices[i]).role is Role.TRAIN and d.version == version and d.state in (READY, HOLDING)
        ]  # fmt: skip
        free = [i for i in usable if devices[i].state is HOLDING] + [i for i in usable if devices[i].state is READY]
        share = 0.0
        if book.queue and free:
            # an even share of the tokens queued now, counting train devices still shifting in, and
            # never more than every device's share of the step: a backlog handed whole to the few
            # devices training when it arrives would run on them alone while the devices the plan
            # sends next find an empty queue; small shares rebalance as devices free up. Shares are
            # counted in tokens, not groups: the groups judged last hold the longest responses
            queued = sum(map(book.tokens, book.queue))
            share = min(queued / len(train_devs), queued / len(book.queue) * -(-n // len(fleet)))
        for i in free:
            if not book.queue:
                break
            take = book.take(share)
            fleet.accumulate(i, take)
            cmds.append(Accumulate(i, version, book.shard(take)))
            if rec.train_start is None:
                rec.train_start = self.clock()
        # every backward done (so nothing was handed out above), every train device free, and enough of them
        if rec.accumulated == n and not hold and len(free) == len(train_devs) >= needed():
            assert all(d.state not in (HOLDING, ACCUMULATING) or d.id in train_devs for d in devices), (
                "gradients on a non-train device"
            )
            self.stepping, self.ready = True, False
            fleet.step(train_devs)
            tokens = sum(len(s.response_ids) for s in rec.samples)
            every, step = self.checkpoint_every, rec.step
            checkpoint = bool(every) and step % every == 0 and step < self.last_step
            cmds.append(Step(train_devs, version, tokens, checkpoint))
        return cmds

    def trained(self) -> None:
        self.stepping, self.failed = False, 0

    def update_failed(self, step: int, reason: str) -> None:
        """The optimizer step failed: it runs again once every sample has gone through backward again, unless it
        failed ``UPDATE_ATTEMPTS`` times in a row (``DeviceLostError``)."""
        self.failed += 1
        if self.failed >= UPDATE_ATTEMPTS:
            raise DeviceLostError(
                f"the optimizer step of step {step} failed {self.failed} times in a row (last: {reason})"
            )
        self.stepping, self.ready = False, True
