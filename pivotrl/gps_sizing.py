"""What the GPS will hold for a job, and Ray's object store sized to hold it.

The GPS at its fullest, for a policy of P parameters and a judge of J (who publishes what:
``runtime/job.py``'s ``publish_initial``, the trainers' ``publish`` and ``save_state``):

| piece                     | bytes                 | held                                                        |
| ------------------------- | --------------------- | ----------------------------------------------------------- |
| judge                     | J x judge.dtype       | the whole run, in its serving dtype                          |
| reference                 | P x policy.dtype      | the whole run, where ``train.kl_coef`` > 0                   |
| policy v0                 | P x policy.dtype      | until ``keep_versions`` newer versions are published         |
| policy versions           | keep x P x w          | w: the rollout dtype a sharded trainer publishes in; fp32,   |
|                           |                       | the replicated trainer's replica                             |
| optimizer state           | 2 x 8 P               | replicated: AdamW's two fp32 moments, the new version's      |
|                           |                       | beside the last until ``retain`` drops it                    |
| train state shards        | 12 P (ZeRO), 16 P     | sharded: fp32 master weights and two moments cut over the    |
|                           | (FSDP2)               | ranks, written at a membership change (FSDP2's in the        |
|                           |                       | middle of a step carry the gradient sums too)                |
| checkpoint copy           | 12 P                  | sharded, ``checkpoint.every`` > 0: the state copied at a     |
|                           |                       | checkpoint, beside the shards the group read                 |

A publish lands before ``retain`` drops the oldest version, so v0 and ``keep`` newer versions meet: the
sum is the peak. The object store needs it times :data:`HEADROOM` (its allocator's fragmentation, and objects
other than the GPS's: task arguments and results in flight).

Where the store comes from:

- a Ray instance of the job's own (``ray.init(address="local")``): ``object_store_memory`` is the need, at
  least :data:`FLOOR`, and it is preallocated: ``_system_config={"preallocate_plasma_memory": True}``
  (Ray's ``RAY_CONFIG(bool, preallocate_plasma_memory, false)``, ``src/ray/common/ray_config_def.h``; the
  plasma store then maps its whole file with ``MAP_POPULATE``, ``create_and_mmap_buffer`` in
  ``src/ray/object_manager/plasma/dlmalloc.cc``; the flag is compiled into the wheel's ``_raylet.so``,
  readable there also as ``RAY_preallocate_plasma_memory``). Without it every publish into a part of the store
  not used before pays a page fault per 4 KiB. A machine whose free memory or ``/dev/shm`` cannot hold the
  need is refused before Ray starts.
- a cluster the job joins (``--ray-address``, or a Ray already started in the process): its nodes' stores
  are what they are; each node that runs devices must hold the need (any of them may host a publisher, and a
  fetcher's replica of every version), else the job is refused naming it.

Torch-free: ``pivotrl plan`` and tests read it without torch; Ray is imported only where a cluster is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pivotrl.errors import UserError
from pivotrl.log import logger
from pivotrl.train.traits import TrainerKind

if TYPE_CHECKING:
    from pivotrl.config import JobConfig

HEADROOM = 1.25  # the store's size over the GPS's peak
FLOOR = 512 * 2**20  # the smallest store a local instance gets: room for task arguments and results of a tiny job
WIDEST = 4  # bytes an element of a dtype not named here counts (none of the job's serving dtypes is wider)
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
ADAM = 8  # fp32 bytes a parameter of AdamW's two moments
SHARDS = {TrainerKind.ZERO: 12, TrainerKind.FSDP: 16}  # a sharded train state's bytes a parameter, all ranks
COPY = 12  # a sharded state's bytes a parameter in a checkpoint's copy (never mid-step: no gradients)
GB = 10**9


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES.get(name, WIDEST)


def _unit(n: float) -> tuple[float, str]:
    return (10**12, "TB") if n >= 10**12 else (GB, "GB") if n >= GB else (10**6, "MB")


def size(n: float) -> str:
    """Bytes as a person reads them: TB, GB, or MB below one GB."""
    scale, unit = _unit(n)
    return f"{n / scale:.3g} {unit}"


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the GPS holds at its fullest, by piece (bytes), and the object store that needs."""

    pieces: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.pieces.values())

    @property
    def need(self) -> int:
        return math.ceil(self.total * HEADROOM)

    def line(self) -> str:
        scale, unit = _unit(self.total)
        parts = ", ".join(f"{k} {v / scale:.3g}" for k, v in self.pieces.items() if v) or "nothing"
        held = f"{self.total / scale:.3g} {unit} ({parts})"
        return f"the GPS holds up to {held}; its object store needs {size(self.need)}"


def holdings(
    policy_params: int,
    judge_params: int,
    *,
    trainer: TrainerKind,
    policy_dtype: str,
    rollout_dtype: str,
    judge_dtype: str,
    keep_versions: int,
    reference: bool,
    checkpoints: bool,
) -> Holdings:
    """The GPS's peak for a job, by piece (the table in this module's docstring). Pure arithmetic."""
    if keep_versions < 1:
        raise ValueError(f"keep_versions: got {keep_versions!r}, must be >= 1")
    p = policy_params
    version = 4 if trainer is TrainerKind.REPLICATED else dtype_bytes(rollout_dtype)
    pieces = {
        "judge": judge_params * dtype_bytes(judge_dtype),
        "reference": p * dtype_bytes(policy_dtype) if reference else 0,
        "policy v0": p * dtype_bytes(policy_dtype),
        f"{keep_versions} policy versions": keep_versions * p * version,
    }
    if trainer is TrainerKind.REPLICATED:
        pieces["optimizer state"] = 2 * ADAM * p
    else:
        pieces["train state shards"] = SHARDS[trainer] * p
        pieces["checkpoint copy"] = COPY * p if checkpoints else 0
    return Holdings(pieces)


def _params(path: str) -> int:
    """A checkpoint's parameters from its config.json; 0 where it cannot be read (publishing it stops the job
    later, with the loader's own error)."""
    from pivotrl.model.loader import read_config

    try:
        return read_config(path).num_parameters()
    except UserError:
        return 0


def for_job(cfg: JobConfig, kind: str, keep_versions: int) -> Holdings:
    """The GPS's peak for ``cfg`` on devices of ``kind``, before they start: the trainer by the devices' kind
    (``resolve.base_trainer``: FSDP2 where auto may still settle on ZeRO-1, whose shards are smaller)."""
    from pivotrl.resolve import base_trainer, rollout_dtype_for
    from pivotrl.runtime.devices import shares_gpu

    return holdings(
        _params(cfg.policy.path),
        _params(cfg.judge.path),
        trainer=base_trainer(cfg.train, kind, shares_gpu(kind, cfg.gpus_per_device, cfg.devices)),
        policy_dtype=cfg.policy.dtype,
        rollout_dtype=rollout_dtype_for(cfg, kind),
        judge_dtype=cfg.judge.dtype,
        keep_versions=keep_versions,
        reference=cfg.train.kl_coef > 0,
        checkpoints=cfg.checkpoint.every > 0,
    )


@dataclass(frozen=True, slots=True)
class ObjectStore:
    """Ray's object store as the job has it: its bytes (the smallest of the devices' nodes on a cluster),
    whether it was preallocated (None: a cluster's, not known here), and what the GPS needs of it."""

    bytes: int
    preallocated: bool | None
    gps_bytes: int
    need: int

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "preallocated": self.preallocated, "gps_bytes": self.gps_bytes, "need": self.need}


def local_size(need: int, free_memory: int, shm_free: int) -> int:
    """The store of a local instance: the need, at least :data:`FLOOR` where the machine has room for that;
    one line naming both when its free memory or ``/dev/shm`` cannot hold the need."""
    room = min(free_memory, shm_free)
    if need > room:
        raise UserError(
            f"the GPS of this job needs an object store of {size(need)}; this machine has {size(free_memory)} of "
            f"memory free and {size(shm_free)} free in /dev/shm (smaller models, "
            "or a Ray cluster with --ray-address)"
        )
    return min(max(need, FLOOR), room)


def machine_room(shm: str = "/dev/shm") -> tuple[int, int]:
    """This machine's free memory and free bytes in ``shm`` (where Ray's store lives; 0 where it is absent)."""
    import psutil

    try:
        st = os.statvfs(shm)
        shm_free = st.f_bavail * st.f_frsize
    except OSError:
        shm_free = 0
    return int(psutil.virtual_memory().available), shm_free


def local_store(held: Holdings) -> tuple[ObjectStore, dict[str, Any]]:
    """The store of the job's own Ray instance and the ``ray.init`` arguments that make it (preallocated);
    says both in one line."""
    bytes_ = local_size(held.need, *machine_room())
    store = ObjectStore(bytes_, True, held.total, held.need)
    logger.info("%s; a local object store of %s, preallocated", held.line(), size(bytes_))
    return store, {"object_store_memory": bytes_, "_system_config": {"preallocate_plasma_memory": True}}


def check_nodes(need: int, stores: Mapping[str, float], where: str) -> int:
    """The smallest object store among the nodes that run devices (``stores``: node -> bytes); one line
    naming the node when it cannot hold ``need``."""
    if not stores:
        return 0
    node, smallest = min(stores.items(), key=lambda kv: kv[1])
    if smallest < need:
        raise UserError(
            f"the GPS of this job needs an object store of {size(need)} on each node that runs devices; "
            f"node {node} of {where} has {size(smallest)} (start its nodes with `ray start "
            f"--object-store-memory={need}`, preallocated with RAY_preallocate_plasma_memory=1)"
        )
    return int(smallest)


def device_node_stores(pg: Any, devices: int) -> dict[str, float]:
    """The object store of each node that a device of placement group ``pg`` runs on, by node address."""
    import ray

    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    placed = {table[d] for d in range(devices)}
    return {
        n["NodeManagerAddress"]: float(n["Resources"].get("object_store_memory", 0))
        for n in ray.nodes()
        if n["Alive"] and n["NodeID"] in placed
    }


def joined_store(held: Holdings, pg: Any, devices: int, where: str) -> ObjectStore:
    """A joined cluster's store, checked against the need; says it in one line."""
    smallest = check_nodes(held.need, device_node_stores(pg, devices), where)
    logger.info("%s; the object store of %s holds %s a node", held.line(), where, size(smallest))
    return ObjectStore(smallest, None, held.total, held.need)
