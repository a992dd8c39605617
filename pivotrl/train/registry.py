"""The trainers by kind: the one place a trainer's name picks its implementation.

Callers build a trainer here and use it through :class:`~pivotrl.train.protocol.Trainer` and its
``traits``; an unknown name fails here, naming those there are.
"""

from __future__ import annotations

from collections.abc import Callable

from pivotrl.train.fsdp import FsdpTrain
from pivotrl.train.protocol import Trainer, TrainSetup
from pivotrl.train.replicated import ReplicatedTrain
from pivotrl.train.traits import TrainerKind, traits
from pivotrl.train.zero import ZeroTrain

TRAINERS: dict[TrainerKind, Callable[[TrainSetup], Trainer]] = {
    TrainerKind.FSDP: FsdpTrain,
    TrainerKind.ZERO: ZeroTrain,
    TrainerKind.REPLICATED: ReplicatedTrain,
}


def build(name: str | TrainerKind, setup: TrainSetup) -> Trainer:
    """The trainer ``name`` of a device taking the train role (see :class:`TrainSetup`)."""
    return TRAINERS[traits(name).kind](setup)
