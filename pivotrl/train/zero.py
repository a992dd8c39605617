"""ZeRO-1 elastic GRPO trainer: backward as groups are judged, optimizer state sharded at the step.

Why. Shiftable mode wins by training while the rollout's tail still runs: a
group is backpropagated as soon as its judgments are in, on whichever device
holds the train role then. The FSDP2 trainer (:mod:`pivotrl.train.fsdp`)
cannot do that: under FSDP every forward and backward is a collective, so it
buffers the step's groups and backpropagates them all in lockstep after the
last judgment. The replicated trainer can, but holds 16 bytes a parameter
(fp32 weights, gradients and both AdamW moments): ~120 GB for a 7.6B policy.

Layout (``train.backend=zero``). Each train device holds

* the weights in the compute dtype (``train.precision``: bf16 on GPU), 2 bytes a
  parameter, loaded at the shift from the GPS version rollout ran (which is
  that dtype: :func:`check_dtypes`);
* one float32 gradient sum, 4 bytes a parameter, that every backward adds into
  parameter by parameter as autograd finishes it (a post-accumulate hook), so a
  bf16 gradient is rounded once per micro batch, never summed in bf16;
* its 1/W share of the float32 master weights and AdamW moments, 12/W bytes a
  parameter, for the W devices of the step's group.

For a 7.6B policy on 8 devices that is ~57 GB a GPU before activations (15 +
30 + 11); FSDP2 needs ~16/W but cannot overlap. Backward needs no collective,
so it runs the moment a group arrives, alone.

The step, over the W ranks of the group (the parameters as one flat vector,
cut into W ranges the way ``torch.chunk`` cuts)::

    gather stats (versions checked) → reduce-scatter the gradient sums (SUM)
    → divide by the batch's tokens → global norm (one all-reduce) → clip
    → AdamW on the local range of the master weights
    → all-gather the updated weights into every rank's compute copy

AdamW is elementwise, so updating a range of one flat tensor is the same
arithmetic as updating every parameter whole: the update equals one device's
(up to the order of floating-point sums) whatever W is and whichever rank
backpropagated which group.

State between steps. The master range and moments stay on the device while
the group holds (the driver keeps a group until a step names another set:
:mod:`pivotrl.runtime.groups`). When the set changes, or the device leaves the
train role, each rank writes its range to the GPS under
``<model>.shard<r>of<W>`` (meta ``layout: flat``) and the next group reads the
parts that fall in its own ranges.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pivotrl.gps import Kind, ParameterStore, Snapshot, VersionError, cast
from pivotrl.log import logger
from pivotrl.model.experts import checkpoint_parts, copy_span, part_view, per_expert_order
from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig
from pivotrl.train.group import TrainGroup, gather_step_stats
from pivotrl.train.loss import GRPOLoss, step_report
from pivotrl.train.models import policy_models
from pivotrl.train.protocol import StepResult, TrainSetup
from pivotrl.train.shards import ShardedTrain, free_shards, row_range, shard_name
from pivotrl.train.traits import TRAITS, TrainerKind

LAYOUT = "flat"  # the meta mark of this trainer's shards (FSDP2's are cut per parameter, by rows)
STACKED = "stacked"  # the meta mark of a flat vector whose experts are stacked parameters (``_segments``)
_MOMENTS = ("exp_avg", "exp_avg_sq")
CHUNK = 1 << 24  # elements AdamW updates at once: its temporaries stay ~128 MB, not two copies of the range
SLACK = 4096  # spare elements after the gradient sum: the padding of a reduce-scatter over up to this many ranks


def check_dtypes(compute: torch.dtype, rollout: torch.dtype) -> None:
    """The compute copy is loaded from the version rollout ran, so it must not be narrower than the compute
    dtype: fp32 compute from bf16 rollout weights would train other weights than the master's."""
    if compute.itemsize > rollout.itemsize:
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        raise ValueError(
            f"train.backend=zero computes in {name(compute)} from the weights the rollout runs ({name(rollout)}), "
            "which would round them: set train.precision=bf16, or policy.rollout_dtype=float32"
        )


class ZeroTrainer:
    """One device's part of a ZeRO-1 GRPO trainer. ``model`` holds the weights in the compute dtype (version
    ``version``); ``ref`` the frozen reference policy when ``cfg.kl_coef > 0``. Without a group (between a shift
    and the step) it only backpropagates."""

    def __init__(
        self, model: nn.Module, cfg: TrainConfig, temperature: float, version: int, ref: nn.Module | None = None
    ) -> None:
        self.model, self.cfg, self.version = model, cfg, version
        self.trainer = GRPOLoss(model, cfg, temperature, ref_model=ref)  # (the step is its own: AdamW on a range)
        self.params = list(model.parameters())
        self.names = [n for n, _ in model.named_parameters()]
        self.spans: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            self.spans.append((offset, offset + p.numel()))
            offset += p.numel()
        self.numel = offset
        device = self.params[0].device
        self.grads = torch.zeros(offset + SLACK, dtype=torch.float32, device=device)
        self._dirty = False  # the buffer holds the last step's gathered weights: zero it before adding
        self._got = [False] * len(self.params)  # which parameters received a gradient since the step
        for i, (p, (a, b)) in enumerate(zip(self.params, self.spans, strict=True)):
            p.register_post_accumulate_grad_hook(self._hook(i, a, b))
        self.group: TrainGroup | None = None
        self.master: Tensor | None = None  # this rank's range of the fp32 weights ...
        self.moments: dict[str, Tensor] | None = None  # ... and of AdamW's moments, once it has stepped
        self.adam_steps = 0.0
        self.imported: tuple[int, int] | None = None  # (version, world size) of the GPS shards read
        self.exported = False  # this version's range is in the GPS already
        self._gathered: Tensor | None = None  # the step's full fp32 weights, until published

    def _hook(self, i: int, a: int, b: int) -> Any:
        # the hook lives on the parameter, in C++, where Python's collector cannot see it: holding the trainer
        # there would make an uncollectable cycle (parameter -> hook -> trainer -> model -> parameter), and a
        # trainer released at a shift would keep its weights and gradient sum on the device for good
        ref = weakref.ref(self)

        def add(p: Tensor) -> None:
            trainer = ref()
            if trainer is None:  # (released: nothing backpropagates through its model any more)
                return
            trainer.grads[a:b].view_as(p).add_(p.grad)
            p.grad = None  # the sum lives in the buffer; the next backward writes a fresh gradient
            trainer._got[i] = True

        return add

    def _clear(self) -> None:
        self.grads.zero_()
        self._dirty, self._gathered = False, None

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    def _range(self) -> tuple[int, int]:
        return row_range(self.numel, self.rank, self.world_size)

    # -- backward ----------------------------------------------------------------------------------------------------
    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Backward these samples now, on this device alone; the gradient sums wait in the buffer for the step."""
        if self._dirty:
            self._clear()
        return self.trainer.accumulate(samples, advantages)

    # -- the group and its state -------------------------------------------------------------------------------------
    def bind(self, group: TrainGroup) -> None:
        """Take ``group`` for the steps to come; the master range is then read with :meth:`load_weights` (no state
        yet) or :meth:`import_shards`."""
        self.group, self.master, self.moments, self.exported = group, None, None, False

    def detach(self) -> None:
        """Leave the group (its state written to the GPS first, by the caller): the compute copy and the
        gradient sums stay, for the next group."""
        self.group, self.master, self.moments = None, None, None

    def _new_master(self, values: Tensor, step: float | None, moments: dict[str, Tensor] | None) -> None:
        self.master, self.moments, self.adam_steps = values, moments, step or 0.0

    def _adamw(self, grad: Tensor) -> None:
        """torch's single-tensor AdamW (decoupled weight decay, no amsgrad), chunk by chunk of the range: the
        same arithmetic element by element as ``torch.optim.AdamW(foreach=False)`` on each parameter."""
        cfg, master = self.cfg, self.master
        assert master is not None
        if self.moments is None:
            self.moments = {key: torch.zeros_like(master) for key in _MOMENTS}
        self.adam_steps += 1
        step = self.adam_steps
        step_size = cfg.lr / (1 - cfg.beta1**step)
        bias_correction2_sqrt = (1 - cfg.beta2**step) ** 0.5
        exp_avg, exp_avg_sq = self.moments["exp_avg"], self.moments["exp_avg_sq"]
        for a in range(0, master.numel(), CHUNK):
            p, g = master[a : a + CHUNK], grad[a : a + CHUNK]
            m, v = exp_avg[a : a + CHUNK], exp_avg_sq[a : a + CHUNK]
            if cfg.weight_decay != 0:
                p.mul_(1 - cfg.lr * cfg.weight_decay)
            m.lerp_(g, 1 - cfg.beta1)
            v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
            p.addcdiv_(m, denom, value=-step_size)

    def load_weights(self, snap: Snapshot | None) -> None:
        """This rank's range of the master weights from a published version (None: from the compute copy itself,
        exact where it is float32), with fresh AdamW state: the first update of a run."""
        a, b = self._range()
        values = torch.empty(b - a, dtype=torch.float32, device=self.grads.device)
        for name, p, (lo, hi) in zip(self.names, self.params, self.spans, strict=True):
            if hi <= a or lo >= b:
                continue
            x, y = max(lo, a), min(hi, b)
            if snap is None:
                values[x - a : y - a].copy_(p.detach().reshape(-1)[x - lo : y - lo])
                continue
            try:  # (the version names checkpoint tensors: a stacked expert parameter is several)
                copy_span(values[x - a : y - a], snap.tensors, name, p.shape, x - lo)
            except KeyError as e:
                raise VersionError(f"{snap.manifest.model_name} v{snap.version} has no tensor {e.args[0]!r}") from None
        self._new_master(values, None, None)
        if snap is not None:
            self.version = snap.version
        self.imported, self.exported = None, False

    def export_shard(self, store: ParameterStore, model_name: str, *, leaving: bool = True) -> int:
        """Write this rank's range of the master weights and AdamW moments to the GPS; returns the bytes written.
        ``leaving``: the state leaves the device (not written twice); False for a checkpoint's copy."""
        if self.master is None or self.group is None:
            return 0
        tensors = {"param": self.master}
        step = None
        if self.moments is not None:
            step = self.adam_steps
            tensors |= self.moments
        meta = {"layout": LAYOUT, "rank": self.rank, "world_size": self.world_size, "numel": self.numel, "step": step,
                "experts": STACKED}  # fmt: skip
        try:
            info = store.publish(shard_name(model_name, self.rank, self.world_size), self.version, tensors,
                                 Kind.OPTIMIZER, meta)  # fmt: skip
        except VersionError:  # written already (released, then asked again): versions are immutable
            return 0
        self.exported = self.exported or leaving
        return info.nbytes

    def import_shards(self, store: ParameterStore, model_name: str, version: int, world_size: int) -> int:
        """Take up the state of ``version`` written by a group of ``world_size``: this rank's range filled from
        the old ranges that overlap it. Returns the bytes read."""
        a, b = self._range()
        snaps = [store.fetch(shard_name(model_name, r, world_size), version, Kind.OPTIMIZER) for r in range(world_size)]
        meta = snaps[0].manifest.meta
        if meta.get("layout") != LAYOUT or meta.get("numel") != self.numel:
            raise ValueError(
                f"{model_name} v{version}: the train state in the GPS was written by another trainer "
                f"(layout {meta.get('layout', 'fsdp rows')!r}, {meta.get('numel')} values; this one: {LAYOUT!r}, "
                f"{self.numel}): resume with the train.backend that wrote it"
            )
        step = meta.get("step")
        device = self.grads.device
        targets = {"param": torch.empty(b - a, dtype=torch.float32, device=device)}
        if step is not None:
            targets |= {key: torch.zeros(b - a, dtype=torch.float32, device=device) for key in _MOMENTS}
        nbytes = 0
        for start, old, count in self._segments(meta.get("experts") == STACKED):
            x, y = max(start, a), min(start + count, b)  # this rank's part of the segment, in this layout
            if x >= y:
                continue
            x_old, y_old = old + x - start, old + y - start
            for r, snap in enumerate(snaps):
                lo, hi = row_range(self.numel, r, world_size)
                u, v = max(lo, x_old), min(hi, y_old)
                if u >= v:
                    continue
                for key, target in targets.items():
                    src = snap.tensors[key][u - lo : v - lo]
                    target[u - x_old + x - a : v - x_old + x - a].copy_(src)
                    nbytes += src.numel() * src.element_size()
        param = targets.pop("param")
        self._new_master(param, step, targets if step is not None else None)
        self.version, self.imported, self.exported = version, (version, world_size), False
        return nbytes

    def _segments(self, stacked: bool) -> list[tuple[int, int, int]]:
        """(start here, start in the stored vector, length): the runs of values that keep their order between the
        stored flat vector and this one. One run, unless the vector was written by a decoder with one parameter
        per expert (``experts`` not ``stacked`` in its meta) and this model stacks them: then one per expert
        tensor, which that vector holds in another order (``per_expert_order``)."""
        params = [(n, p.shape) for n, p in zip(self.names, self.params, strict=True)]
        if stacked or all(len(checkpoint_parts(n, shape)) == 1 for n, shape in params):
            return [(0, 0, self.numel)]
        stored = {p.name: p.offset for p in per_expert_order(params)}
        return [(lo + part.offset, stored[part.name], part.numel)
                for (name, shape), (lo, _) in zip(params, self.spans, strict=True)
                for part in checkpoint_parts(name, shape)]  # fmt: skip

    def free_imported(self, store: ParameterStore, model_name: str) -> None:
        """Drop the GPS shards this state was read from (rank 0, once the group has stepped past them)."""
        free_shards(store, model_name, self.imported)
        self.imported = None

    # -- the step ----------------------------------------------------------------------------------------------------
    def step(self, total_tokens: int | None = None) -> StepResult:
        """The optimizer step over the bound group (call on every rank). Returns the group's numbers (identical on
        every rank, with ``world_size`` and the new ``version``), and 0 tokens and 0 seconds of backward: that ran
        before, as the groups came."""
        group = self.group
        if group is None or self.master is None:
            raise RuntimeError("step() needs a group and its state: bind() it, then load_weights or import_shards")
        world = group.world_size
        if self._dirty:
            self._clear()
        if world > 1:
            try:
                sums, got = gather_step_stats(group, self.version, self.trainer.pending_stats, self._got)
            except RuntimeError:  # (another version's gradients: none of them is of use)
                self.trainer.discard()
                self._clear()
                self._got = [False] * len(self.params)
                raise
        else:
            sums, got = self.trainer.pending_stats, list(self._got)
        accumulated = int(sums.get("tokens", 0))
        n = accumulated if total_tokens is None else total_tokens
        if n < accumulated:
            raise ValueError(f"total_tokens={n} is less than the {accumulated} tokens the group accumulated")
        if any(got) and not all(got):
            missing = [name for name, g in zip(self.names, got, strict=True) if not g]
            raise RuntimeError(f"no gradient for {missing[:5]} on any rank: every parameter must take part")
        self.trainer.discard()  # the running sums were read above; the gradients are in the buffer
        self._got = [False] * len(self.params)
        a, b = self._range()
        size = -(-self.numel // world)
        if self.grads.numel() < size * world:  # more ranks than the slack pads for: grow it once
            self.grads = torch.cat([self.grads, self.grads.new_zeros(size * world - self.grads.numel())])
        if world > 1:
            shard = torch.empty(size, dtype=torch.float32, device=self.grads.device)
            group.reduce_scatter_(shard, self.grads[: size * world])
        else:
            shard = self.grads[:size]  # (one rank: its range is the whole sum, in place)
        grad = shard[: b - a]
        skipped = n == 0 or not any(got)
        if skipped:
            logger.warning("no response tokens accumulated; skipping the optimizer step")
            grad_norm = 0.0
        else:
            grad.div_(n)
            squares = torch.linalg.vector_norm(grad).double().square().reshape(1)
            grad_norm = float(group.all_reduce_(squares).sqrt())
            skipped = not math.isfinite(grad_norm)
            if skipped:
                logger.warning("non-finite grad norm %s; skipping the optimizer step", grad_norm)
        if not skipped:
            if self.cfg.grad_clip > 0:  # torch's clip_grads_with_norm_: the coefficient in float32, at most 1
                coef = torch.tensor(self.cfg.grad_clip, dtype=torch.float32) / (grad_norm + 1e-6)
                if coef < 1:
                    grad.mul_(coef.to(grad.device))
            self._adamw(grad)
        self._gather(shard, world)
        self.version += 1
        self.exported = False
        out = step_report(sums, n, grad_norm, skipped)
        out["world_size"], out["version"] = float(world), float(self.version)
        return StepResult(out, self.version, world)

    def _gather(self, shard: Tensor, world: int) -> None:
        """Every rank's updated range into the full fp32 vector (the gradient buffer, free now), then into the
        compute copy. The vector is kept for :meth:`publish_weights` until the next backward clears it."""
        a, b = self._range()
        size = shard.numel()
        shard[: b - a].copy_(self.master)
        shard[b - a :].zero_()
        full = self.grads[: size * world]
        if world > 1:
            assert self.group is not None
            self.group.all_gather_into_(full, shard)
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.spans, strict=True):
                p.copy_(full[lo:hi].view_as(p))
        self._gathered, self._dirty = full[: self.numel], True

    def publish_weights(self, store: ParameterStore, model_name: str, dtype: torch.dtype, meta: dict[str, Any]) -> int:
        """Rank 0 writes the weights of ``self.version`` in ``dtype`` to the GPS, cast from the fp32 master
        weights the step gathered; returns the bytes published (0 on the other ranks)."""
        if self.rank != 0:
            return 0
        src = self._gathered
        if src is None:
            raise RuntimeError("publish_weights() goes right after step(): a backward since has cleared the weights")
        start = time.perf_counter()
        # the compute weights were cast from these master weights at the step: where they have the dtype to
        # publish, they are the very bytes; either way each tensor is copied once, into the GPS's buffer
        tensors = {}
        for name, p, (lo, hi) in zip(self.names, self.params, self.spans, strict=True):
            flat = p.detach().view(-1) if p.dtype == dtype else src[lo:hi]
            for part in checkpoint_parts(name, p.shape):  # (the checkpoints' names: stacked experts are several)
                view = part_view(flat, part)
                tensors[part.name] = view if p.dtype == dtype else cast(view, dtype)
        nbytes = store.publish(model_name, self.version, tensors, Kind.WEIGHTS, meta).nbytes
        logger.debug("zero: published %s v%d (%d bytes) in %.3f s", model_name, self.version, nbytes,
                     time.perf_counter() - start)  # fmt: skip
        return nbytes


class ZeroTrain(ShardedTrain):
    """The train role on a device with ZeRO-1 (``train.backend=zero``): the weights in the compute dtype (from
    the version rollout ran) and an fp32 gradient sum, built at the shift; groups are backpropagated as they
    arrive. :class:`ZeroTrainer` (``shard``) takes its range of the master weights and AdamW state when it
    joins a group, and keeps its weights and gradient sums when it leaves one."""

    traits = TRAITS[TrainerKind.ZERO]

    def __init__(self, setup: TrainSetup) -> None:
        super().__init__(setup)
        check_dtypes(setup.compute, setup.rollout)
        model, ref, self.nbytes = policy_models(setup, setup.compute)
        self.shard: ZeroTrainer | None = ZeroTrainer(model, setup.cfg, setup.temperature, setup.version, ref)

    def _zero(self) -> ZeroTrainer:
        assert self.shard is not None, "released"
        return self.shard

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        return self._zero().accumulate(samples, advantages)  # (alone, now: no collective in the backward)

    def join(self, group: TrainGroup, state_world: int) -> None:
        zero = self._zero()
        if zero.group is not group:  # the group's state: its range of it
            zero.bind(group)
            self.load_state(state_world)

    def load_state(self, state_world: int) -> int:
        """This rank's range of the state of this version: from the ranges a group of ``state_world`` wrote,
        or (0) from the published weights, with fresh AdamW state. The bytes read from ranges."""
        s, zero = self.setup, self._zero()
        if state_world:
            return zero.import_shards(s.store, s.policy, self.version, state_world)
        zero.load_weights(s.store.fetch(s.policy, self.version))
        return 0

    def step(self, total_tokens: int | None) -> StepResult:
        result = self._zero().step(total_tokens)
        self.version = result.version
        return result

    def leave(self) -> None:
        self._zero().detach()  # its weights and gradient sums stay for the next group

    def release(self) -> None:
        self.shard = None
