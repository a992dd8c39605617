"""The fleet of device views: what the control plane knows of each device (its role, the policy version it holds,
what it is doing), the devices holding each role, and turning the allocation policy's targets into shifts and
aborts.

A device view is in one state at a time; the transitions, all written here:

    READY --Shift--> SHIFTING --ShiftDone--> READY
    READY --Abort--> ABORTING --Aborted--> READY            (its requests go back to their queue)
    READY/HOLDING --Accumulate--> ACCUMULATING --Accumulated--> HOLDING   (gradients of this step: it stays)
    READY/HOLDING --Step--> STEPPING --Trained/StepFailed--> READY
    any --DeviceLost--> LOST --DeviceJoined--> READY (no role)

A READY device holds its role (or none) and takes that role's work; every other state pins the device where it is.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import itemgetter

from pivotrl.control.messages import Abort, Command, Role, Shift, ShiftDone, Step


class DeviceState(enum.Enum):
    READY = "ready"  # in its role (generating, judging, or idle), taking that role's work
    SHIFTING = "shifting"  # a Shift in flight
    ABORTING = "aborting"  # an Abort in flight
    ACCUMULATING = "accumulating"  # a backward in flight; holds gradients of this step
    HOLDING = "holding"  # holds gradients of this step: stays in the train role until the optimizer step
    STEPPING = "stepping"  # in the optimizer step
    LOST = "lost"  # died or hung; out of every role until it joins again


@dataclass(slots=True)
class DeviceView:
    id: int
    role: Role | None = None
    version: int = -1
    state: DeviceState = DeviceState.READY
    leaving: Role | None = None  # aborted to take this role: it shifts there next, whatever the plan says by then
    heading: Role | None = None  # the role of the shift in flight
    in_backward: int = 0  # samples of the Accumulate in flight (0: none)
    held: list[int] = field(default_factory=list)  # samples (indexes) handed to its backward this step
    # holds its shard of a sharded train state, which nothing else holds: it stepped in the last optimizer step
    # and has not shifted since (a shift writes the shard to the GPS first)
    shard: bool = False

    @property
    def lost(self) -> bool:
        return self.state is DeviceState.LOST


READY, SHIFTING, ABORTING, LOST = DeviceState.READY, DeviceState.SHIFTING, DeviceState.ABORTING, DeviceState.LOST
ACCUMULATING, HOLDING, STEPPING = DeviceState.ACCUMULATING, DeviceState.HOLDING, DeviceState.STEPPING


class Fleet:
    """The device views, the devices holding each role, and the devices ready for more of their role's work.

    ``steer`` remembers what it last looked with: a device's next move follows from its state, its load, its
    target and the policy version, so with the same targets and version only the devices touched since (an event
    or a command) are looked at again."""

    def __init__(self, devices: int, partial_rollout: bool = False) -> None:
        self.devices = [DeviceView(i) for i in range(devices)]
        # a rollout device an update left behind hands its sequences over (they go on with the newer weights) and
        # reloads at once, instead of finishing them first (partial_rollout)
        self.partial_rollout = partial_rollout
        self._holders: dict[Role, set[int]] = {role: set() for role in Role}
        self._pick_role: dict[Role, Callable[[tuple[int, ...]], Iterable[int]]] = {}  # see role_load
        self._touched: set[int] = set()
        self._looked: tuple[dict[int, Role] | None, int] = (None, -1)
        self.wanted: Counter[Role] = Counter()  # the devices each role is to have, by the targets last looked with
        self._ready: dict[Role | None, set[int]] = {role: set() for role in (*Role, None)}

    def __len__(self) -> int:
        return len(self.devices)

    def __getitem__(self, i: int) -> DeviceView:
        return self.devices[i]

    # -- roles ----------------------------------------------------------------------
    def holders(self, role: Role) -> list[int]:
        """The devices holding ``role``, in device order."""
        return sorted(self._holders[role])

    def ready(self, role: Role) -> list[int]:
        """The devices holding ``role`` ready for more of its work (as the last ``steer`` found them)."""
        return sorted(self._ready[role])

    def role_load(self, role: Role, loads: tuple[int, ...]) -> int:
        """Requests in flight on the devices holding ``role``: their loads picked in C (an
        ``itemgetter`` kept until a device joins or leaves the role), not read one by one."""
        pick = self._pick_role.get(role)
        if pick is None:
            ids = sorted(self._holders[role])
            if len(ids) > 1:
                pick = itemgetter(*ids)
            else:  # (an itemgetter of one index gives the item, not a tuple)
                pick = lambda loads, ids=ids: [loads[i] for i in ids]  # noqa: E731
            self._pick_role[role] = pick
        return sum(pick(loads))

    def _leave_role(self, d: DeviceView) -> None:
        if d.role is not None:
            self._holders[d.role].discard(d.id)
            self._pick_role.pop(d.role, None)

    def layout(self) -> tuple[tuple[Role | None, ...], frozenset[int]]:
        """The role of every device as the planner sees it, and the devices it may not move."""
        # (a lost device too: planned into a role, it would count there, and a step that needs as many train
        # devices would wait for one that does not come)
        pinned = frozenset(d.id for d in self.devices if d.state is not READY)
        # a device on its way to a role counts as holding it: planned back to the role it is
        # leaving, it would shift straight back on arrival
        roles = tuple(d.heading if d.state is SHIFTING else d.leaving or d.role for d in self.devices)
        return roles, pinned

    def alive(self, ids: Iterable[int]) -> tuple[int, ...]:
        """``ids`` less the lost devices."""
        devices = self.devices
        return tuple(i for i in ids if devices[i].state is not LOST)

    # -- steering -------------------------------------------------------------------
    def touch(self, ids: Iterable[int]) -> None:
        """Devices that had an event: the next ``steer`` looks at them again."""
        self._touched.update(ids)

    def touch_commands(self, cmds: list[Command]) -> None:
        """Whoever got a command is looked at again next time."""
        for c in cmds:
            if isinstance(c, Step):
                self._touched.update(c.devices)
            else:
                self._touched.add(c.device)

    def look_again(self) -> None:
        """The next ``steer`` looks at every device, as if the targets had changed."""
        self._looked = (None, -1)

    def steer(self, targets: dict[int, Role], loads: tuple[int, ...], version: int, preempt: bool) -> list[Command]:
        """Each device shifts (or aborts its work) towards its target, or, holding the rollout or judge role and
        staying, is ready for more of its work (``ready``). ``preempt``: a device may leave a role with requests
        in flight (they migrate); else it finishes them first."""
        if targets != self._looked[0] or version != self._looked[1]:
            visit: Iterable[int] = range(len(self.devices))
            self._looked = (dict(targets), version)
            self.wanted = Counter(r for i, r in targets.items() if self.devices[i].state is not LOST)
        else:
            visit = sorted(self._touched)
        self._touched = set()
        cmds: list[Command] = []
        devices, ready_sets, rollout, judge = self.devices, self._ready.values(), Role.ROLLOUT, Role.JUDGE
        for i in visit:
            d = devices[i]
            for ready in ready_sets:  # (looked at again: ready for its role's work below, or not)
                ready.discard(i)
            if d.state is not READY:
                continue
            leaving = d.leaving
            want = targets[i] if leaving is None else leaving
            if loads[i]:
                if d.role is not want and preempt:  # leave now: its requests migrate
                    cmds.append(Abort(i))
                    d.state, d.leaving = ABORTING, want  # a decision acted on is kept: no work comes back to it
                elif leaving is None and (d.role is not rollout or d.version == version):
                    self._ready[d.role].add(i)  # (a stale rollout device finishes its work, takes no more ...)
                elif leaving is None and self.partial_rollout and d.role is rollout:  # (... or hands it over)
                    cmds.append(Abort(i))
                    d.state, d.leaving = ABORTING, want
                continue
            d.leaving = None
            if d.role is not want or (want is not judge and d.version != version):  # or stale
                cmds.append(Shift(i, want, version))
                d.state, d.heading = SHIFTING, want
            else:  # a rollout device's version is current: it would be shifting
                self._ready[d.role].add(i)
        return cmds

    # -- transitions ----------------------------------------------------------------
    def shifted(self, e: ShiftDone) -> None:
        """A shift landed: the device holds ``e.role`` at ``e.version`` (its shard, if any, is in the GPS)."""
        d = self.devices[e.device]
        self._leave_role(d)
        self._holders[e.role].add(d.id)
        self._pick_role.pop(e.role, None)
        d.role, d.version, d.shard = e.role, e.version, False
        if d.state is SHIFTING:
            d.state = READY

    def abort(self, i: int) -> None:
        """Some requests of device ``i`` are taken back (the rollout rebalanced): an Abort goes to it."""
        self.devices[i].state = ABORTING

    def aborted(self, i: int) -> None:
        d = self.devices[i]
        if d.state is ABORTING:
            d.state = READY

    def accumulate(self, i: int, samples: list[int]) -> None:
        """Device ``i`` is handed ``samples`` for its backward: it holds gradients of this step from now on."""
        d = self.devices[i]
        d.held += samples
        d.state, d.in_backward = ACCUMULATING, len(samples)

    def accumulated(self, i: int) -> None:
        d = self.devices[i]
        d.in_backward = 0
        if d.state is ACCUMULATING:
            d.state = HOLDING

    def step(self, ids: Iterable[int]) -> None:
        """Devices ``ids`` run the optimizer step."""
        for i in ids:
            self.devices[i].state = STEPPING

    def stepped(self, ids: Iterable[int], version: int, shard: bool) -> None:
        """The optimizer step is done on ``ids``: their replica is ``version`` (with its shard of a sharded
        state: ``shard``); no device holds gradients of the step any more."""
        for d in self.devices:
            d.held = []
        for i in ids:
            d = self.devices[i]
            if d.state in (STEPPING, HOLDING):
                d.state = READY
            d.version = version
            d.shard = shard

    def step_failed(self, ids: Iterable[int]) -> None:
        """The optimizer step failed on ``ids``: their gradients are gone, and their train state is stale (the
        pump shifts them into the train role again, reloading from the GPS)."""
        for i in ids:
            d = self.devices[i]
            if d.state in (STEPPING, HOLDING, ACCUMULATING):
                d.state = READY
            d.in_backward = 0
            d.held = []
            d.version = -1

    def lose(self, i: int) -> DeviceView:
        """Device ``i`` is lost: out of every role until it joins again. Returns its view as it was."""
        d = self.devices[i]
        self._leave_role(d)
        self.devices[i] = DeviceView(i, state=LOST)
        self._touched.add(i)
        self._looked = (None, -1)  # every device is looked at again: the roles are to be spread anew
        return d

    def join(self, i: int) -> None:
        """Device ``i`` joins (again), holding no role."""
        self.devices[i] = DeviceView(i)
        self._touched.add(i)
        self._looked = (None, -1)
