"""Instances: the control plane's devices, each ``tensor_parallel`` of the job's devices on one node.

The control plane (and the simulator) plans in instances: it shifts, fills
and trains whole instances, and never sees the devices inside one. The Ray
driver maps each command on an instance to its devices:

    instance i = tp devices of one node                (placed: each node's in order, in runs of tp)
    generation (generate, judge, abort, looks)  -> the instance's first device, which drives
                                                   the ranks of its engines on every device of it
    shift                                       -> every device (each leaves its role's context;
                                                   the first wakes the engine ranks)
    accumulate                                  -> every device, the judged groups split among them
    optimizer step over instances (i, j, ...)   -> every device of each, a trainer rank each

and what comes back to one instance event: the first device's, with a shift's
bytes and an accumulation's samples summed over its devices and their
seconds the longest. A device of an instance lost loses the instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pivotrl.control.messages import Accumulated, ShiftDone, TrainShard


@dataclass(frozen=True, slots=True)
class Member:
    """A device's place in its instance: the instance's index, the device's rank in it (0: the one that drives
    its engines), and the instance's bundles (its devices' placement-group bundles, rank order)."""

    instance: int
    rank: int
    bundles: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Instances:
    """The job's devices grouped in instances of ``size``: ``groups[i]`` holds instance i's devices, rank order."""

    size: int
    groups: tuple[tuple[int, ...], ...]
    _of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not self.groups or any(len(g) != self.size for g in self.groups):
            raise ValueError(f"instances: {self.groups} are not groups of {self.size} devices")
        object.__setattr__(self, "_of", {d: i for i, g in enumerate(self.groups) for d in g})

    @classmethod
    def uniform(cls, size: int, count: int) -> Instances:
        """``count`` instances of ``size`` consecutive devices."""
        return cls(size, tuple(tuple(range(i * size, (i + 1) * size)) for i in range(count)))

    @classmethod
    def on_nodes(cls, size: int, nodes: list[str]) -> Instances:
        """Instances of ``size`` devices of one node each, device d being on ``nodes[d]``: each node's devices in
        order, cut in runs of ``size`` (instance numbers follow the first device of each). A node whose devices
        are not a whole number of instances is a ``ValueError`` naming it."""
        by_node: dict[str, list[int]] = {}
        for d, node in enumerate(nodes):
            by_node.setdefault(node, []).append(d)
        groups = []
        for node, devices in by_node.items():
            if len(devices) % size:
                raise ValueError(
                    f"node {node} holds {len(devices)} of the job's devices, not a whole number of instances of "
                    f"{size} (an instance's devices share a node)"
                )
            groups += [tuple(devices[k : k + size]) for k in range(0, len(devices), size)]
        return cls(size, tuple(sorted(groups)))

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def devices(self) -> int:
        return self.size * self.count

    def members(self, instance: int) -> tuple[int, ...]:
        """The devices of ``instance``, rank order."""
        return self.groups[instance]

    def first(self, instance: int) -> int:
        return self.groups[instance][0]

    def of(self, device: int) -> int:
        """The instance of ``device``."""
        return self._of[device]

    def member(self, device: int) -> Member:
        instance = self.of(device)
        group = self.groups[instance]
        return Member(instance, group.index(device), group)

    def ranks(self, instances: tuple[int, ...]) -> tuple[int, ...]:
        """The devices of an optimizer step over ``instances``: every device of each, instance by instance (the
        step's ranks, in this order)."""
        return tuple(d for i in instances for d in self.groups[i])


def split_shard(shard: TrainShard, parts: int) -> list[TrainShard]:
    """``shard`` cut into ``parts`` consecutive runs of whole samples (sizes differing by one at most; a part
    may be empty): the gradients of a token-sum loss add up to the same whatever the cut."""
    n = len(shard.advantages)
    bounds = [n * k // parts for k in range(parts + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out.append(
            replace(
                shard,
                prompt_ids=shard.prompt_ids[lo:hi],
                response_ids=shard.response_ids[lo:hi],
                logprobs=shard.logprobs[lo:hi],
                advantages=shard.advantages[lo:hi],
            )
        )
    return out


def combine_shifts(events: list[ShiftDone]) -> ShiftDone:
    """One instance's shift from its devices' (the first's first): bytes summed, the longest time."""
    first = events[0]
    return replace(first, seconds=max(e.seconds for e in events), nbytes=sum(e.nbytes for e in events))


def combine_accumulated(events: list[Accumulated]) -> Accumulated:
    """One instance's accumulation from its devices': samples and tokens summed, the longest time."""
    first = events[0]
    return replace(
        first,
        samples=sum(e.samples for e in events),
        tokens=sum(e.tokens for e in events),
        seconds=max(e.seconds for e in events),
    )
