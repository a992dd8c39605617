"""Queued requests to the devices ready for them, and the rollout rebalanced once nothing is queued.

A role's queue goes to the devices holding the role and ready for more (the fleet's last look), with room kept
for the devices still joining the role (``wanted`` less those ready): the scheduler holds back what they will
take. Once the rollout queue is empty, sequences in flight on the most loaded rollout devices migrate to the least
loaded, those with the fewest tokens to re-prefill first: a device left with a big batch decodes every step of its
longest sequence slower for it, while a device that emptied idles. Judgments are not moved: with at most a few
hundred tokens left to write, their re-prefill costs about what a smaller batch saves."""

from __future__ import annotations

from pivotrl.control.fleet import Fleet
from pivotrl.control.messages import Abort, Command, Role
from pivotrl.control.scheduler import Scheduler


class RequestDispatch:
    """Whether the rollout devices' loads changed since they were last compared (``due``); ``rebalance``: whether
    the rollout is rebalanced at all (rollout.rebalance)."""

    def __init__(self, rebalance: bool) -> None:
        self.rebalance = rebalance
        self.due = False

    def changed(self) -> None:
        """Rollout loads changed: sequences ended or came back, or a device joined or left the role."""
        self.due = True

    def dispatch(self, scheduler: Scheduler, fleet: Fleet, version: int, so_far: dict[int, int]) -> list[Command]:
        """Generate and Judge commands for the queued requests, then the rebalancing aborts, if due (``so_far``:
        uid -> tokens a running sequence has written, what a migration re-prefills)."""
        cmds: list[Command] = []
        s = scheduler
        if s.gen_queue or s.judge_queue:
            for role, queue in ((Role.ROLLOUT, s.gen_queue), (Role.JUDGE, s.judge_queue)):
                if not queue:
                    continue
                ready = fleet.ready(role)
                joining = max(0, fleet.wanted[role] - len(ready))
                if role is Role.ROLLOUT:
                    sent = s.dispatch_gen(ready, version, joining)
                    self.due |= bool(sent)
                    cmds += sent
                else:
                    cmds += s.dispatch_judge(ready, joining)
        if self.rebalance and self.due and not s.gen_queue:
            self.due = False  # until sequences end, come back or a device joins the role
            for d, uids in s.rebalance(fleet.ready(Role.ROLLOUT), lambda u: so_far.get(u, 0)).items():
                cmds.append(Abort(d, tuple(uids)))
                fleet.abort(d)
        return cmds
