"""The trainers by name, and what the control plane, the resolver and the memory arithmetic read of each.

Torch-free: the job's resolver, ``pivotrl plan``, the simulator and the control plane decide with these
traits, never with a trainer's name. The implementations (torch) are registered under the same names in
``pivotrl.train.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TrainerKind(StrEnum):
    FSDP = "fsdp"
    ZERO = "zero"
    REPLICATED = "replicated"


@dataclass(frozen=True, slots=True)
class TrainerTraits:
    """What a trainer does that others plan around.

    ``lockstep``: every group is backpropagated at the optimizer step, by all the step's train devices
    together (FSDP2 gathers each layer from the group), so nothing is accumulated while the rollout runs;
    otherwise each group is backpropagated alone as soon as it is judged.
    ``unique_state``: the optimizer state (or more) is sharded over the step's train devices, so a device
    lost while it holds its shard loses state no other device has.
    ``host_collectives``: its collectives may go through host memory, so it trains on devices that share a
    GPU (NCCL takes one rank per GPU; FSDP2's collectives need it).
    ``always_grouped``: it makes a process group even on one device (FSDP2 builds its device mesh over one).
    """

    kind: TrainerKind
    lockstep: bool
    unique_state: bool
    host_collectives: bool
    always_grouped: bool = False


TRAITS: dict[TrainerKind, TrainerTraits] = {
    TrainerKind.FSDP: TrainerTraits(TrainerKind.FSDP, True, True, False, always_grouped=True),
    TrainerKind.ZERO: TrainerTraits(TrainerKind.ZERO, False, True, True),
    TrainerKind.REPLICATED: TrainerTraits(TrainerKind.REPLICATED, False, False, True),
}

NAMES = tuple(k.value for k in TrainerKind)


def traits(name: str | TrainerKind) -> TrainerTraits:
    """A trainer's traits by name; an unknown name fails naming those there are."""
    try:
        return TRAITS[TrainerKind(name)]
    except ValueError:
        raise ValueError(f"trainer: got {name!r}, must be one of {', '.join(NAMES)}") from None
