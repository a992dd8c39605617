"""Which train group a step runs on: the driver's side of persistent process groups.

A process group costs a rendezvous (and, with NCCL, communicators and their
memory), so it outlives a step: the devices of a group keep it until a step
names another set of devices. Then the old members retire (write their
sharded train state to the GPS and leave), and the new set meets at rank 0's
node. Both drivers (in-process and Ray) use this bookkeeping; only how a call
reaches a device differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pivotrl.runtime.devices import LOOPBACK


class TrainGroups:
    """The group that stepped last, and the size of the group whose train state the GPS holds."""

    def __init__(self) -> None:
        self.devices: tuple[int, ...] = ()
        self.state_world = 0  # devices of the group that stepped last: its shards are the ones to read

    def plan(
        self,
        devices: tuple[int, ...],
        retire: Callable[[int], Any],
        listen: Callable[[int, int], Any] | None,
    ) -> tuple[Any, list[Any]]:
        """The rendezvous to pass to each rank's step (None: keep the held group) and what to wait for.

        ``retire(device)`` is called for every member of the old group when the
        set changes (its results are what the new ranks wait for); ``listen(rank0,
        world_size)`` opens rank 0's end of a new group of several devices.
        """
        if devices == self.devices:
            return None, []
        after = [retire(d) for d in self.devices]
        if len(devices) == 1:
            return (LOOPBACK, 0), after  # a group of one meets nobody
        if listen is None:
            raise ValueError(f"a train group of {len(devices)} devices needs a driver that can rendezvous")
        return listen(devices[0], len(devices)), after

    def stepped(self, devices: tuple[int, ...]) -> None:
        self.devices = devices
        self.state_world = len(devices)
