"""Sharded GRPO trainer: FSDP2 over the devices that hold the train role in a step.

Why. A replica of a 7.6B policy with fp32 weights, gradients and AdamW state
is ~120 GB: it fits no GPU. Here parameters, gradients and optimizer state are
sharded over the W train devices (``fully_shard`` per decoder layer and on
the root), so each holds ~16/W bytes per parameter plus one layer's gathered
weights and its activations. Master weights and AdamW state are float32;
with ``precision=bf16`` forward and backward run in bfloat16 (FSDP casts the
gathered parameters) and gradients are reduced in float32.

The update equals one device's. Losses are token *sums*: every rank's
backward adds into sharded gradients whose reduce-scatter is a SUM (FSDP's
default average is switched off), and :meth:`GRPOTrainer.step` divides once by
the batch's token count and clips by the global norm. So the update does not
depend on W or on which rank got which group (up to reduction order).

Lockstep. Under FSDP every forward and backward is a collective, so ranks
cannot each backward whatever groups reach them while the rollout tail runs,
as the replicated trainer does. Groups are buffered as they arrive
(:meth:`add`), and :meth:`step` first shares them (one small all-gather of
token ids), splits them evenly by tokens in an order every rank computes
alike, cuts micro batches, and has a rank that runs out early run weight-0
passes so that all ranks make the same collectives::

    rank r: add(groups) ... add ──┐
                                   ├─ step(): all-gather samples → same split on every rank
    rank s: add(groups) ... add ──┘          micro batches in lockstep (reduce-scatter SUM per backward)
                                             gather stats → divide, clip, AdamW on the local shards

State between steps. While the train set is unchanged the shards stay on the
devices. When it changes, or a device leaves the train role, each rank writes
its shard to the GPS (:meth:`export_shard`: its rows of the fp32 weights and
of each AdamW moment, under ``<model>.shard<r>of<W>``) and the next set
reads the rows that fall in its own shards from whichever old shards hold
them (:meth:`import_shards`). Shards are cut along dimension 0 the way
``torch.chunk`` cuts (what FSDP2 does), so row ranges are pure arithmetic
(:func:`row_range`).

A backward ahead of the step. :meth:`backward_pending` is the step's first half
(the all-gather, the split, the passes) on what the ranks hold now: the
gradient sums stay sharded on the devices until :meth:`step` divides them, so
a group can backpropagate the groups judged so far while the rollout's tail
runs. A step begun by one group can be finished by another: the old ranks
write their shards with the rows of the gradient sums and their loss sums
(``export_shard(partial=True)``, under ``<model>.partial<r>of<W>``: the
version is still the step's first, whose whole shards may be in the GPS
under the plain name), and the new group adds them to its own
(``import_shards(partial=True)``). The update is the one-device update of the
whole batch either way. (The worker runs it only inside :meth:`step` so far:
no command asks a train group for a backward ahead of its step yet.)

Publishing for generation: each parameter is gathered in the rollout dtype,
one at a time, and rank 0 writes it into the GPS version under the
checkpoints' names (a stacked expert parameter as its per-expert tensors); no
full fp32 copy is ever gathered on one rank.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pivotrl.gps import Deferred, Kind, ParameterStore, Snapshot, VersionError
from pivotrl.log import logger
from pivotrl.model import Decoder, ModelConfig
from pivotrl.model.experts import Part, checkpoint_parts, copy_span, part_view
from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig
from pivotrl.train.group import TrainGroup
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.loss import merge_stats
from pivotrl.train.protocol import StepResult, TrainSetup
from pivotrl.train.shards import ShardedTrain, free_shards, row_range, shard_name
from pivotrl.train.traits import TRAITS, TrainerKind

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def balance(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``world_size`` ranks, longest first to the least loaded (ties: lowest
    index, lowest rank): every rank computes the same split from the same lengths."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return out


def _shard_model(
    config: ModelConfig, group: TrainGroup, compute: torch.dtype, checkpointing: bool, frozen: bool = False
) -> Decoder:
    """The model sharded over ``group``, each layer and then the root. ``frozen`` (the KL reference: forward
    only) reshards the root after its forward too: FSDP2 leaves a root's parameters gathered after the
    forward for the backward to use, and a model that never runs backward would keep its embedding and head
    whole on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(group.device.type, (group.world_size,))
    with torch.device("meta"):
        model = Decoder(config)
    model.checkpoint_layers = checkpointing
    if compute == torch.float32:
        policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True if frozen else None)
    model.to_empty(device=group.device)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = torch.tensor(config.inv_freq(), dtype=torch.float32, device=group.device)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums, not means: the step divides by the batch's tokens
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def load_rows(model: Decoder, snap: Snapshot, rank: int, world_size: int) -> None:
    """Copy this rank's rows of every parameter from a full (unsharded) GPS version, whose tensors carry the
    checkpoints' names (a stacked expert parameter's rows are whole experts: ``checkpoint_parts``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            start, stop = row_range(p.shape[0], rank, world_size)
            local = _local(p)
            assert local.shape[0] == stop - start, f"{name}: FSDP holds {local.shape[0]} rows, expected {stop - start}"
            try:
                copy_span(local.view(-1), snap.tensors, name, p.shape, start * (p.numel() // p.shape[0]))
            except KeyError as e:
                raise VersionError(f"{snap.manifest.model_name} v{snap.version} has no tensor {e.args[0]!r}") from None


class _Joined(Mapping[str, Tensor]):
    """Whole tensors under ``key`` (``param``, a moment, ``grad``) from shards that each hold rows of them, joined
    as they are read: the per-expert tensors of train state written with one parameter per expert."""

    def __init__(self, snaps: Sequence[Snapshot], key: str) -> None:
        self.snaps, self.prefix = snaps, f"{key}."

    def __getitem__(self, name: str) -> Tensor:
        return torch.cat([s.tensors[self.prefix + name] for s in self.snaps])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.prefix + name in self.snaps[0].tensors

    def __iter__(self) -> Iterator[str]:
        return (n.removeprefix(self.prefix) for n in self.snaps[0].tensors if n.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ShardedTrainer:
    """One rank's part of an FSDP2 GRPO trainer over ``group``, holding policy ``version``."""

    def __init__(
        self,
        group: TrainGroup,
        config: ModelConfig,
        cfg: TrainConfig,
        temperature: float,
        version: int,
        compute_dtype: torch.dtype = torch.float32,
        reference: Snapshot | None = None,
    ) -> None:
        self.group, self.config, self.cfg, self.version = group, config, cfg, version
        # (a train device's config comes resolved by the job's plan, a bool; a bare config's auto counts as off)
        self.model = _shard_model(config, group, compute_dtype, cfg.activation_checkpointing is True)
        ref = None
        if cfg.kl_coef > 0:
            if reference is None:
                raise ValueError(f"train.kl_coef is {cfg.kl_coef} (> 0), which needs the reference policy")
            ref = _shard_model(config, group, compute_dtype, False, frozen=True)
            load_rows(ref, reference, group.rank, group.world_size)
            ref.requires_grad_(False)
        self.trainer = GRPOTrainer(self.model, cfg, temperature, ref_model=ref)
        self.pending: list[tuple[Sample, float]] = []
        self.partial: dict[str, float] = {}  # this rank's loss sums of the backward done ahead of the step
        self.imported: tuple[int, int] | None = None  # (version, world size) of the GPS shards this state came from
        self.imported_partial = False  # ... and whether those were written in the middle of a step
        self.exported = False  # this version's shard is in the GPS already

    @property
    def rank(self) -> int:
        return self.group.rank

    # -- state in and out ------------------------------------------------------------------------------------------
    def load_weights(self, snap: Snapshot) -> None:
        """Start from a published weights version with fresh optimizer state (the first update of a run)."""
        load_rows(self.model, snap, self.rank, self.group.world_size)
        self.version = snap.version

    @property
    def mid_step(self) -> bool:
        """Gradient sums are held: of a backward done ahead of the step (``backward_pending``), or of a step
        broken off (which only ``partial`` export would write, and nothing should ask it to)."""
        return any(p.grad is not None for p in self.model.parameters())

    def export_shard(
        self, store: ParameterStore, model_name: str, *, leaving: bool = True, partial: bool = False
    ) -> int:
        """Write this rank's rows of the master weights and AdamW moments to the GPS; returns bytes written.

        ``partial``: in the middle of a step (a backward done ahead of it, ``backward_pending``), the rows of
        the gradient sums and this rank's loss sums go too, under the partial name (``shard_name``): the next
        group takes the step up where this one leaves it. Without it, gradients held are refused, as they are
        after a step broken off (they are not the step's). Buffered samples must go through
        ``backward_pending`` first. ``leaving``: the state leaves the device (a membership change, a
        release): it is not written twice. False for a copy taken for a checkpoint, under its own
        ``model_name``."""
        if self.pending:
            raise RuntimeError("export_shard with buffered samples: backward_pending() or step() first")
        if self.mid_step and not partial:
            raise RuntimeError("export_shard with gradients held: step() first, or export them with partial=True")
        if partial and not leaving:
            raise RuntimeError("a checkpoint copy in the middle of a step: step() first")
        tensors: dict[str, Tensor] = {}
        rows: dict[str, int] = {}
        steps: dict[str, float] = {}
        state = self.trainer.optimizer.state
        for name, p in self.model.named_parameters():
            rows[name] = p.shape[0]
            tensors[f"param.{name}"] = _local(p.detach())
            if p in state and state[p]:
                steps[name] = float(state[p]["step"])
                for key in _STATE_KEYS:
                    tensors[f"{key}.{name}"] = _local(state[p][key])
            if p.grad is not None:
                tensors[f"grad.{name}"] = _local(p.grad)
        meta = {"rank": self.rank, "world_size": self.group.world_size, "rows": rows, "step": steps}
        if partial:
            meta["partial"] = dict(self.partial)
        name = shard_name(model_name, self.rank, self.group.world_size, partial)
        try:
            info = store.publish(name, self.version, tensors, Kind.OPTIMIZER, meta)
        except VersionError:  # written already (released, then asked again): versions are immutable
            return 0
        self.exported = self.exported or leaving
        return info.nbytes

    def import_shards(
        self, store: ParameterStore, model_name: str, version: int, world_size: int, partial: bool = False
    ) -> int:
        """Take up the state of ``version`` written by a group of ``world_size``: each local shard is filled from
        the old shards whose rows overlap it. ``partial``: written in the middle of a step, with gradient sums,
        which this group adds to (and rank 0 the old ranks' loss sums). Returns the bytes read."""
        if self.pending or self.mid_step:
            raise RuntimeError("import_shards into a trainer holding samples or gradients")
        snaps = [store.fetch(shard_name(model_name, r, world_size, partial), version, Kind.OPTIMIZER)
                 for r in range(world_size)]  # fmt: skip
        if "rows" not in snaps[0].manifest.meta:
            layout = snaps[0].manifest.meta.get("layout")
            raise ValueError(
                f"{model_name} v{version}: the train state in the GPS was written by another trainer (layout "
                f"{layout!r}; this one: fsdp rows): resume with the train.backend that wrote it"
            )
        spans = [(s, {n: row_range(rows, r, world_size) for n, rows in s.manifest.meta["rows"].items()})
                 for r, s in enumerate(snaps)]  # fmt: skip
        state = self.trainer.optimizer.state
        nbytes = 0
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                a, b = row_range(p.shape[0], self.rank, self.group.world_size)
                targets = {"param": _local(p)}
                # (stacked experts written by a decoder with one parameter per expert: under those names)
                stored = name if name in spans[0][1] else checkpoint_parts(name, p.shape)[0].name
                step = snaps[0].manifest.meta["step"].get(stored)
                if step is not None:
                    moments = {key: torch.zeros_like(p) for key in _STATE_KEYS}
                    targets |= {key: _local(t) for key, t in moments.items()}
                if f"grad.{stored}" in snaps[0].tensors:  # (every old rank holds every gradient, zero or not)
                    p.grad = torch.zeros_like(p)
                    targets["grad"] = _local(p.grad)
                if stored != name:
                    for key, target in targets.items():
                        copy_span(target.view(-1), _Joined(snaps, key), name, p.shape, a * (p.numel() // p.shape[0]))
                        nbytes += target.numel() * target.element_size()
                    if step is not None:
                        state[p] = {"step": torch.tensor(step, dtype=torch.float32), **moments}
                    continue
                for snap, ranges in spans:
                    lo, hi = ranges[name]
                    lo, hi = max(lo, a), min(hi, b)
                    if lo >= hi:
                        continue
                    base = ranges[name][0]
                    for key, target in targets.items():
                        src = snap.tensors[f"{key}.{name}"][lo - base : hi - base]
                        target[lo - a : hi - a].copy_(src)
                        nbytes += src.numel() * src.element_size()
                if step is not None:
                    state[p] = {"step": torch.tensor(step, dtype=torch.float32), **moments}
        self.partial = {}
        if partial and self.rank == 0:  # the old ranks' loss sums, each counted once: by the new rank 0
            for snap in snaps:
                merge_stats(self.partial, snap.manifest.meta.get("partial", {}))
        self.version, self.imported, self.exported = version, (version, world_size), False
        self.imported_partial = partial
        return nbytes

    def free_imported(self, store: ParameterStore, model_name: str) -> None:
        """Drop the GPS shards this state was read from (rank 0, once the group has stepped past them)."""
        free_shards(store, model_name, self.imported, self.imported_partial)
        self.imported, self.imported_partial = None, False

    def publish_weights(self, store: ParameterStore, model_name: str, dtype: torch.dtype, meta: dict[str, Any]) -> int:
        """Publish the current weights in ``dtype`` as ``self.version``: every rank gathers one parameter at
        a time (a collective, each rank casting its shard first), and rank 0 copies each into the GPS's buffer
        as it comes, holding one gathered parameter at a time and no host copy of the model beside the
        buffer. Returns the bytes published (0 on the other ranks)."""
        params = list(self.model.named_parameters())
        done, broken = 0, False
        gathered: list[Tensor] = []  # the parameter whose checkpoint tensors are being copied, flat

        def gather(p: nn.Parameter) -> Tensor:
            nonlocal done, broken
            self.group.mark()  # (gathering a parameter is a collective)
            try:
                full = p.detach().to(dtype)
                full = full.full_tensor() if hasattr(full, "full_tensor") else full
            except BaseException:
                broken = True
                raise
            done += 1
            return full

        with torch.no_grad():
            if self.rank != 0:
                for _, p in params:
                    gather(p)
                return 0

            def part(p: nn.Parameter, piece: Part, first: bool, last: bool) -> Tensor:
                if first:
                    gathered[:] = [gather(p).reshape(-1)]
                view = part_view(gathered[0], piece)
                if last:
                    gathered.clear()
                return view

            tensors = {
                piece.name: Deferred(dtype, piece.shape, functools.partial(part, p, piece, i == 0, i == len(parts) - 1))
                for name, p in params
                for parts in [checkpoint_parts(name, p.shape)]
                for i, piece in enumerate(parts)
            }
            try:
                return store.publish(model_name, self.version, tensors, Kind.WEIGHTS, meta).nbytes
            finally:  # the store gave up before the last gather (a version already there): the others still wait
                if not broken:
                    for _, p in params[done:]:
                        gather(p)

    # -- the step --------------------------------------------------------------------------------------------------
    def add(self, samples: list[Sample], advantages: Sequence[float]) -> int:
        """Buffer judged samples until the step; returns their response tokens."""
        pairs = self.trainer.check(samples, advantages)
        self.pending += pairs
        return sum(len(s.response_ids) for s, _ in pairs)

    def backward_pending(self) -> tuple[int, float]:
        """Backward every rank's buffered samples now, in lockstep, ahead of the step: their gradients add into
        the sharded sums the step divides, and this rank's loss sums wait in ``partial``. Every rank of the
        group calls it together (its passes are collectives). Returns the tokens that went through forward
        and backward on all ranks (prompts and responses) and the seconds that took."""
        group, world = self.group, self.group.world_size
        mine = [(s.prompt_ids, s.response_ids, s.logprobs, a) for s, a in self.pending]
        self.pending = []
        shared: list[Any] = [None] * world
        if world > 1:
            group.mark()
            dist.all_gather_object(shared, (self.version, mine))
        else:
            shared = [(self.version, mine)]
        versions = [v for v, _ in shared]
        if len(set(versions)) > 1:
            self.trainer.discard()
            self.partial = {}
            raise RuntimeError(
                f"train group {group.address}: ranks hold different policy versions {versions} (by rank); "
                "a device that newly takes the train role must import the current version's state first"
            )
        pairs = [
            (Sample(i, 0, "", "", list(p), 0, response_ids=list(r), logprobs=list(lp)), a)
            for i, (p, r, lp, a) in enumerate(x for _, part in shared for x in part)
        ]
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s, _ in pairs]
        split = balance(lengths, world)
        plans = [self.trainer.plan([pairs[i] for i in sorted(idx)]) for idx in split]
        passes = max((len(p) for p in plans), default=0)
        start = time.perf_counter()
        stats: dict[str, float] = {}
        for i in range(passes):
            group.mark()  # (each pass gathers and reduces shards with the other ranks)
            if i < len(plans[self.rank]):
                merge_stats(stats, self.trainer.backward(plans[self.rank][i]))
            else:
                self.trainer.backward([pairs[0]], weight=0.0)  # nothing left here: match the others' collectives
        merge_stats(self.partial, stats)
        logger.debug("sharded backward of v%d on %d ranks: %d samples, %d passes", self.version, world, len(pairs),
                     passes)  # fmt: skip
        return sum(lengths), time.perf_counter() - start

    def step(self, total_tokens: int | None = None) -> StepResult:
        """Backward every rank's buffered samples in lockstep, then the optimizer step on every rank, over the
        gradient sums of every backward of the step (those done ahead of it, here or by an earlier group).

        Returns the group's numbers (identical on every rank, plus ``world_size``
        and the new ``version``), the tokens that went through forward and
        backward on all ranks in this call (prompts and responses) and the seconds that took.
        """
        group, world = self.group, self.group.world_size
        tokens, backward_s = self.backward_pending()
        stats, self.partial = self.partial, {}
        if world > 1:
            every: list[Any] = [None] * world
            group.mark()
            dist.all_gather_object(every, stats)
            stats = {}
            for part in every:
                merge_stats(stats, part)
        out = self.trainer.step(total_tokens, stats)
        self.version += 1
        self.exported = False
        out["world_size"] = float(world)
        out["version"] = float(self.version)
        logger.debug("sharded step v%d on %d ranks", self.version, world)
        return StepResult(out, self.version, world, tokens, backward_s)


class FsdpTrain(ShardedTrain):
    """The train role on a device with FSDP2 (``train.backend=fsdp``). Nothing heavy is built at the shift:
    the shards depend on the group, known at the step. Groups wait in ``pending`` until then; joining a group
    new to it builds :class:`ShardedTrainer` over that group (``shard``), which lives until the group does."""

    traits = TRAITS[TrainerKind.FSDP]

    def __init__(self, setup: TrainSetup) -> None:
        super().__init__(setup)
        self.config = ModelConfig.from_hf(self.meta["config"])  # the policy's architecture
        self.nbytes = 0
        self.pending: list[tuple[list[Sample], list[float]]] = []
        self.shard: ShardedTrainer | None = None

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        self.pending.append((samples, list(advantages)))  # (backpropagated in lockstep at the step)
        return {}

    def join(self, group: TrainGroup, state_world: int) -> None:
        if self.shard is not None and self.shard.group is group:
            return
        s = self.setup
        reference = s.store.fetch(s.reference, 0) if s.cfg.kl_coef > 0 else None
        self.shard = ShardedTrainer(group, self.config, s.cfg, s.temperature, self.version, s.compute, reference)
        self.load_state(state_world)

    def load_state(self, state_world: int) -> int:
        """The group's shards of this version: from those a group of ``state_world`` wrote, or (0) from the
        published weights, with fresh AdamW state. The bytes read from shards."""
        s, shard = self.setup, self.shard
        assert shard is not None
        if state_world:
            return shard.import_shards(s.store, s.policy, self.version, state_world)
        shard.load_weights(s.store.fetch(s.policy, self.version))
        return 0

    def step(self, total_tokens: int | None) -> StepResult:
        assert self.shard is not None, "join() a group before the step"
        for samples, advantages in self.pending:
            self.shard.add(samples, advantages)
        self.pending = []
        result = self.shard.step(total_tokens)
        self.version = result.version
        return result

    def leave(self) -> None:
        self.shard = None  # its shards belong to the old group's mesh

    def release(self) -> None:
        self.shard, self.pending = None, []
