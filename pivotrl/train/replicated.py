"""Replicated data-parallel GRPO: the train role on however many devices hold it in a step.

Why elastic. Devices shift between rollout, judge and train while a step runs,
so the number of train devices changes from step to step. The update must not
depend on it (up to floating-point reduction order): the policy after step v
is the same whether 1, 2 or 7 devices trained it.

Why that holds. :class:`~pivotrl.train.grpo.GRPOTrainer` backpropagates the
*unnormalised* token-sum loss and divides once by the token count of the whole
batch. Sums split over devices: each rank accumulates the groups it was given,
:meth:`ElasticTrainer.step` all-reduces (SUM) the gradient sums, and every
rank then runs the same ``GRPOTrainer.step(total_tokens)`` (divide, clip by
global norm, AdamW) on identical gradients and identical optimizer state, so
the replicas stay identical without ever exchanging weights.

Layout (``train.backend=replicated``). Every train device holds the full
weights and the full AdamW state; the sharded alternatives, for models a
device cannot hold whole, are :mod:`pivotrl.train.fsdp` (FSDP2) and
:mod:`pivotrl.train.zero` (ZeRO-1), over the same
:class:`~pivotrl.train.group.TrainGroup`.

A device that newly takes the train role first loads the policy weights and
optimizer state of the current version from the GPS
(:meth:`ElasticTrainer.import_state`), published by one of the previous train
devices (:meth:`ElasticTrainer.export_state`). Each step checks that every
rank holds the same policy version, so a rank that skipped the import fails
the step on every rank at once instead of silently diverging.

What waits for what in one step::

    rank r: accumulate(its groups) ... accumulate  ──┐
                                                     ├─ step(): gather stats (1 small collective, checks versions)
    rank s: accumulate(its groups) ... accumulate  ──┘         all-reduce grads (1 collective per bucket)
                                                               GRPOTrainer.step on every rank (no communication)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from pivotrl.gps import Kind, ParameterStore, load_optimizer_state, module_tensors, publish_model, publish_optimizer
from pivotrl.log import logger
from pivotrl.sample import Sample
from pivotrl.train.group import TrainGroup, gather_step_stats
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.models import policy_models
from pivotrl.train.protocol import StepResult, TrainSetup
from pivotrl.train.traits import TRAITS, TrainerKind

DEFAULT_BUCKET_BYTES = 256 << 20  # gradient bytes per all-reduce; bounds the extra memory of the flat buffer


def _buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters grouped by (dtype, device), in model order, cut into buckets of at most ``bucket_bytes``.

    Depends only on the model, so every replica builds the same buckets and
    the collectives line up. A parameter larger than a bucket gets its own.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    out: list[list[nn.Parameter]] = []
    for group in by_kind.values():
        bucket: list[nn.Parameter] = []
        size = 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            out.append(bucket)
    return out


class ElasticTrainer:
    """A :class:`GRPOTrainer` on one replica of the policy, stepping in lockstep with the rest of its group.

    ``version`` is the policy version the replica's weights hold (the one
    rollout used for this step's samples); each :meth:`step` advances it, and
    it names what :meth:`export_state` publishes. ``group`` may be replaced
    between steps when the membership changes; gradients accumulated so far
    stay valid, since they are sums. Without a group the trainer is alone
    (world size 1, no process group).
    """

    def __init__(
        self,
        trainer: GRPOTrainer,
        group: TrainGroup | None = None,
        version: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes!r}")
        self.trainer = trainer
        self.version = version
        self._params = list(trainer.model.parameters())
        self._buckets = _buckets(self._params, bucket_bytes)
        self.group = TrainGroup.join(0, 1, device=trainer.device) if group is None else group

    @property
    def group(self) -> TrainGroup:
        return self._group

    @group.setter
    def group(self, group: TrainGroup) -> None:
        if self.trainer.device.type != group.device.type:
            raise ValueError(
                f"the policy is on {self.trainer.device} but the train group communicates over {group.device} "
                f"({group.backend}); they must be the same kind of device"
            )
        self._group = group

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Backward this rank's share of the batch (local sums; nothing is communicated until :meth:`step`)."""
        return self.trainer.accumulate(samples, advantages)

    def global_tokens(self) -> int:
        """Response tokens accumulated by the whole group since the last step (one collective; call on every rank)."""
        count = torch.tensor([float(self.trainer.pending_tokens)], dtype=torch.float64, device=self.group.device)
        return int(self.group.all_reduce_(count).item())

    def _all_reduce_grads(self, has_grad: list[bool]) -> None:
        """Sum every gradient over the group, one flat buffer per bucket; a missing gradient counts as zeros.

        The reduced buffer becomes the gradients (views into it), so the extra
        memory is one bucket, not a second copy of every gradient. A parameter
        with no gradient on any rank keeps ``grad=None``, exactly as in
        one-rank training (AdamW then leaves it and its state alone).
        """
        grad_of = dict(zip(map(id, self._params), has_grad, strict=True))
        for bucket in self._buckets:
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            views = []
            for p in bucket:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                views.append(view)
                offset += p.numel()
            self.group.all_reduce_(flat)
            for p, view in zip(bucket, views, strict=True):
                if grad_of[id(p)]:
                    p.grad = view

    def step(self, total_tokens: int | None = None) -> StepResult:
        """All-reduce the gradient sums, then apply the same token-mean AdamW update on every rank.

        ``total_tokens`` is the response-token count of the whole batch, which
        the control plane knows; ``None`` takes what the group accumulated.
        Call on every rank of the group, even one that got no samples: the
        collectives need all of them. Returns the group's numbers (loss and
        clip fraction over all ranks' tokens), identical on every rank, plus
        ``world_size`` and the new ``version`` (in ``stats``).
        """
        group = self.group
        if group.world_size > 1:
            try:
                sums, has_grad = gather_step_stats(
                    group, self.version, self.trainer.pending_stats, [p.grad is not None for p in self._params]
                )
            except RuntimeError:
                self.trainer.discard()
                raise
            accumulated = int(sums["tokens"])
            if total_tokens is not None and total_tokens < accumulated:
                raise ValueError(
                    f"total_tokens={total_tokens} is less than the {accumulated} tokens the group accumulated"
                )
            if total_tokens is not None and total_tokens > accumulated:
                logger.warning("total_tokens=%d, but the group accumulated only %d", total_tokens, accumulated)
            if accumulated:
                self._all_reduce_grads(has_grad)
            out = self.trainer.step(total_tokens, sums)  # the group's sums: every rank reports the whole batch
        else:
            out = self.trainer.step(total_tokens)
        self.version += 1
        out["world_size"] = float(group.world_size)
        out["version"] = float(self.version)
        return StepResult(out, self.version, group.world_size)

    def export_state(self, store: ParameterStore, model_name: str, *, weights: bool = True) -> int:
        """Publish this replica's optimizer state (and weights) as ``self.version``; returns the bytes published.

        Replicas are identical, so one rank of the group publishes (rank 0 by
        convention). ``weights=False`` when the weights of this version are
        published separately, e.g. by the publish phase for rollout.
        """
        if self.trainer.pending_tokens or any(p.grad is not None for p in self._params):
            raise RuntimeError("export_state with accumulated gradients: step() first, the state would be mid-step")
        nbytes = 0
        if weights:
            nbytes += publish_model(store, model_name, self.version, self.model).nbytes
        nbytes += publish_optimizer(store, model_name, self.version, self.trainer.optimizer, self.model).nbytes
        return nbytes

    def import_state(self, store: ParameterStore, model_name: str, version: int, *, weights: bool = True) -> int:
        """Take up the train role at ``version``: load its weights and optimizer state from the GPS.

        ``weights=False`` when the replica already holds that version's
        weights (e.g. it just served rollout with them). Returns the bytes loaded.
        """
        if self.trainer.pending_tokens or any(p.grad is not None for p in self._params):
            raise RuntimeError("import_state with accumulated gradients: they belong to other weights; step() first")
        start, nbytes = time.perf_counter(), 0
        if weights:
            snap = store.fetch(model_name, version)
            snap.load_into(self.model)
            nbytes += snap.nbytes
        state = store.fetch(model_name, version, Kind.OPTIMIZER)
        load_optimizer_state(state, self.trainer.optimizer, self.model)
        self.version = version
        logger.debug("train state of %s v%d imported in %.3f s", model_name, version, time.perf_counter() - start)
        return nbytes + state.nbytes


class ReplicatedTrain:
    """The train role on a device with a whole replica (``train.backend=replicated``): the policy in float32
    and its AdamW state, built at the shift from the GPS; groups are backpropagated as they arrive. Replicas
    are identical, so rank 0 publishes each new version with its optimizer state, and a device that takes the
    role later reads both (:meth:`load_state`)."""

    traits = TRAITS[TrainerKind.REPLICATED]

    def __init__(self, setup: TrainSetup) -> None:
        self.setup = setup
        self.meta = setup.weights.manifest.meta  # architecture and tokenizer, published again with each version
        self.model, ref, self.nbytes = policy_models(setup, torch.float32)
        trainer = GRPOTrainer(self.model, setup.cfg, setup.temperature, ref, setup.compute)
        self.replica = ElasticTrainer(trainer, version=setup.version)
        self.nbytes += self.load_state()

    @property
    def version(self) -> int:
        return self.replica.version

    def load_state(self) -> int:
        """The optimizer state of this version from the GPS (none before the first update); the bytes read."""
        s = self.setup
        if self.version not in s.store.versions(s.policy, Kind.OPTIMIZER):
            return 0
        return self.replica.import_state(s.store, s.policy, self.version, weights=False)

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        return self.replica.accumulate(samples, advantages)

    def join(self, group: TrainGroup, state_world: int) -> None:
        self.replica.group = group  # (every replica holds the whole state: nothing to read)

    def step(self, total_tokens: int | None) -> StepResult:
        return self.replica.step(total_tokens)

    def publish(self, checkpoint: bool) -> None:
        """Rank 0 publishes the weights and the optimizer state of the new version (a checkpoint reads them
        there: nothing more to copy for it)."""
        s = self.setup
        if self.replica.group.rank != 0:
            return
        s.store.publish(s.policy, self.version, module_tensors(self.model), Kind.WEIGHTS, self.meta)
        self.replica.export_state(s.store, s.policy, weights=False)  # optimizer state of the same version
        s.store.retain(s.policy, s.keep_versions, Kind.WEIGHTS)
        s.store.retain(s.policy, 1, Kind.OPTIMIZER)

    def save_state(self) -> int | None:
        return None  # (published with every version)

    def leave(self) -> None:
        pass  # (the next group replaces it at join)

    def release(self) -> None:
        del self.model, self.replica
