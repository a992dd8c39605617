"""What the two sharded trainers (FSDP2, ZeRO-1) share: where their state goes in the GPS, and how a device
publishes and saves it.

A sharded train state is cut over the W ranks of the group that holds it; each rank writes its part under
``<model>.shard<r>of<W>`` (:func:`shard_name`) when the group changes or the device leaves the train role,
and the next group reads the parts that overlap its own. Cuts follow ``torch.chunk`` (what FSDP2 does), so
which rows a rank holds is arithmetic (:func:`row_range`).
"""

from __future__ import annotations

from typing import Any

import torch

from pivotrl.gps import Kind, ParameterStore, VersionError
from pivotrl.train.protocol import TrainSetup


def shard_name(model_name: str, rank: int, world_size: int, partial: bool = False) -> str:
    """GPS name of rank ``rank``'s train-state shard in a group of ``world_size`` (``partial``: written in the
    middle of a step, its gradient sums with it, under a name of its own: the version is still the one the
    step started from, whose whole shards the group before may have written under the plain name)."""
    return f"{model_name}.{'partial' if partial else 'shard'}{rank}of{world_size}"


def row_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor of ``rows`` rows that rank ``rank`` of ``world_size`` holds.

    ``torch.chunk``'s cut, which FSDP2 uses: chunks of ceil(rows / W) rows, the
    last ones shorter or empty.
    """
    size = -(-rows // world_size)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def free_shards(
    store: ParameterStore, model_name: str, imported: tuple[int, int] | None, partial: bool = False
) -> None:
    """Drop the GPS shards of ``imported`` (version, world size) of a sharded train state, those still there."""
    if imported is None:
        return
    version, world_size = imported
    for r in range(world_size):
        try:
            store.free(shard_name(model_name, r, world_size, partial), version, Kind.OPTIMIZER)
        except VersionError:
            pass


class ShardedTrain:
    """The part of a sharded trainer's device role that does not depend on how it shards: publishing the new
    version and saving the state. ``shard`` is the device's part of the trainer (``publish_weights``,
    ``export_shard``, ``free_imported``, ``exported``, ``group``), None while it has none."""

    def __init__(self, setup: TrainSetup) -> None:
        self.setup = setup
        self.version = setup.version
        self.meta: dict[str, Any] = setup.weights.manifest.meta  # architecture and tokenizer, for each publish
        self.shard: Any = None

    def publish(self, checkpoint: bool) -> None:
        """Every rank gathers the new weights in the rollout dtype (rank 0 writes them); with ``checkpoint``
        every rank's shard is copied to the GPS before rank 0 reports the step done."""
        s, shard = self.setup, self.shard
        group = shard.group
        shard.publish_weights(s.store, s.policy, s.rollout, self.meta)
        if checkpoint:
            shard.export_shard(s.store, s.checkpoint, leaving=False)
            group.all_reduce_(torch.zeros(1, device=group.device))
        if group.rank == 0:
            shard.free_imported(s.store, s.policy)
            s.store.retain(s.policy, s.keep_versions, Kind.WEIGHTS)

    def save_state(self) -> int | None:
        """This rank's shard to the GPS, unless it is there already."""
        if self.shard is None or self.shard.exported:
            return None
        return self.shard.export_shard(self.setup.store, self.setup.policy)
