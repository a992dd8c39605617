"""Recovery of lost devices: a device that died or hung left its role without notice, and the work it held begins
again elsewhere (its sequences and judgments from the start, the samples of its lost gradients through backward
again), unless it held what nothing else holds: then this attempt at the run ends (``DeviceLostError``) and the
job resumes from its newest checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pivotrl.control.fleet import STEPPING, DeviceView
from pivotrl.control.messages import GenRequest, JudgeRequest, Role
from pivotrl.control.scheduler import Scheduler
from pivotrl.control.spec import DeviceLostError


@dataclass(slots=True)
class LostWork:
    """What a lost device held: generation and judge requests to begin again, and the samples (indexes) whose
    gradients it held, of which ``in_backward`` were in a backward not yet reported done."""

    gen: list[GenRequest] = field(default_factory=list)
    judge: list[JudgeRequest] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    in_backward: int = 0

    def __len__(self) -> int:
        return len(self.gen) + len(self.judge) + len(self.held)


class Recovery:
    """The devices lost so far (``log``: when, device, why)."""

    def __init__(self, sharded_train: bool) -> None:
        self.sharded_train = sharded_train
        self.log: list[tuple[float, int, str]] = []

    def check(self, d: DeviceView, step: int, reason: str) -> None:
        """Raise ``DeviceLostError`` where losing ``d`` loses state nothing else holds: its part of a sharded
        optimizer step (in step ``step``), or its shard of the sharded train state."""
        where = f"device {d.id} ({d.role.value if d.role else 'no role'})"
        if d.state is STEPPING and self.sharded_train:
            raise DeviceLostError(f"{where} was lost in the optimizer step of step {step}: {reason}")
        if d.shard:
            raise DeviceLostError(f"{where} was lost holding its shard of the sharded train state: {reason}")

    def lost(
        self,
        d: DeviceView,
        scheduler: Scheduler,
        gen_request: Callable[[int], GenRequest],
        judge_request: Callable[[int], JudgeRequest],
        now: float,
        reason: str,
    ) -> LostWork:
        """The work of lost device ``d`` (its view as it was): the requests in flight on it go back to the front of
        their queue, from the start of its role; returned with the samples of its gradients, to go through
        backward again, unless the optimizer step that consumed them was under way (it is done again, or was
        done: ``StepFailed`` or ``Trained`` tells)."""
        work = LostWork()
        for uid in sorted(scheduler.running(d.id)):
            if d.role is Role.JUDGE:
                work.judge.append(judge_request(uid))
            else:
                work.gen.append(gen_request(uid))
        scheduler.forget(d.id)
        scheduler.submit_gen(work.gen, front=True)
        scheduler.submit_judge(work.judge, front=True)
        if d.state is not STEPPING:
            work.held, work.in_backward = d.held, d.in_backward
        self.log.append((now, d.id, reason))
        return work
