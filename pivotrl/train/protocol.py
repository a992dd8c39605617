"""The trainer interface: what a device in the train role asks of its trainer, whichever it is.

Torch-free (the names it uses from torch-side modules are for type checkers only), so the control plane,
the resolver and the simulator may read :class:`StepResult` and :class:`TrainSetup` without importing
torch. The implementations register by :class:`~pivotrl.train.traits.TrainerKind` in
:mod:`pivotrl.train.registry`; a caller uses this protocol and the trainer's ``traits``, never a trainer's
name or internals.

A trainer's life on a device, from the shift into the train role to the shift out of it::

    build (setup)                   weights (and state) of the version from the GPS, as the trainer needs them
    accumulate(group) ...           backward now, or buffered until the step (``traits.lockstep``)
    join(group, state_world)        the step's train group; a new group reads its state from the GPS
    step(total_tokens) -> StepResult
    publish(checkpoint)             the new version to the GPS (rank 0 writes), old versions dropped
    ... (more steps, on the same group or a new one: leave() then join())
    save_state()                    state no other device holds goes to the GPS before it leaves the device
    release()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pivotrl.train.config import TrainConfig
from pivotrl.train.traits import TrainerTraits

if TYPE_CHECKING:
    import torch

    from pivotrl.gps import ParameterStore, Snapshot
    from pivotrl.sample import Sample
    from pivotrl.train.group import TrainGroup


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports, the same on every rank of its group.

    ``stats``: the group's numbers over the whole batch (loss, clip fraction, grad norm, ...), with
    ``world_size`` and ``version`` as the metrics record them. ``tokens`` and ``backward_s``: the tokens
    (prompts and responses, all ranks) that went through forward and backward inside the step and the
    seconds that took; 0 for a trainer that backpropagated every group before the step.
    """

    stats: dict[str, float]
    version: int
    world_size: int
    tokens: int = 0
    backward_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TrainSetup:
    """What a trainer is built from when its device takes the train role at ``version``.

    ``cfg`` is concrete (activation checkpointing decided); ``compute`` the dtype forward and backward run
    in; ``rollout`` the dtype of the weights the rollout runs (what a trainer publishes).
    ``policy``/``reference``/``checkpoint`` name the GPS models: the policy's versions (and its train
    state), the frozen reference policy of the KL term, and the copy of a sharded train state taken for a
    checkpoint. ``weights``: the policy's version ``version``, fetched at the shift. ``keep_versions``: the
    policy's weight versions kept in the GPS after a publish.
    """

    store: ParameterStore
    version: int
    weights: Snapshot
    device: torch.device
    cfg: TrainConfig
    temperature: float
    compute: torch.dtype
    rollout: torch.dtype
    policy: str
    reference: str
    checkpoint: str
    keep_versions: int = 2


class Trainer(Protocol):
    """A device's part of a data-parallel GRPO trainer over the train group of each step."""

    traits: TrainerTraits
    version: int  # the policy version its weights hold: the one the samples it accumulates were generated with
    nbytes: int  # bytes read from the GPS when it was built

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Take one judged group: backpropagate it now and return its loss sums, or (``traits.lockstep``)
        keep it for the step and return ``{}``. Gradients are sums until the step divides them."""
        ...

    def join(self, group: TrainGroup, state_world: int) -> None:
        """Step over ``group`` from now on. A group new to this trainer reads its state of ``version`` from
        the GPS: shards written by a group of ``state_world`` devices, or (0) the published weights."""
        ...

    def step(self, total_tokens: int | None) -> StepResult:
        """The optimizer step over the joined group (every member calls it): ``version`` advances by one."""
        ...

    def publish(self, checkpoint: bool) -> None:
        """Put the new version's weights in the GPS for the rollout (rank 0 writes; every member calls it),
        and with ``checkpoint`` a copy of the train state a checkpoint can read."""
        ...

    def save_state(self) -> int | None:
        """Write the state only this device holds to the GPS, before it leaves its group or the device;
        the bytes written, or None where there is nothing to write (none, or written already)."""
        ...

    def leave(self) -> None:
        """Drop what belongs to the group (after ``save_state``); what the next group needs stays."""
        ...

    def release(self) -> None:
        """Free what the trainer holds on the device (the shift out of the train role)."""
        ...
