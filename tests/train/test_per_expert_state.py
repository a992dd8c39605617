"""Train state written by a decoder with one parameter per expert and projection (optimizer moments, FSDP2 rows,
ZeRO-1 ranges, all keyed or ordered by those parameters) loads into the stacked experts: the same numbers as
state written with them stacked. Each trainer runs alone here (one rank, in this process); the per-expert state is
made from the stacked one, cut and ordered as such a decoder's trainers cut and order it."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import Tensor, nn

from pivotrl.gps import Kind, LocalStore, load_optimizer_state, optimizer_tensors
from pivotrl.model import Decoder
from pivotrl.model.experts import checkpoint_parts
from pivotrl.train.fsdp import ShardedTrainer
from pivotrl.train.group import TrainGroup
from pivotrl.train.shards import row_range, shard_name
from pivotrl.train.zero import ZeroTrainer
from tests.conftest import tiny_moe_config
from tests.train.test_fsdp import CFG, initial, weights
from tests.train.test_replicated import Batch, batch_tokens, make_batch

EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
PROJECTIONS = ("gate", "up", "down")


def per_expert(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` under checkpoint names in the order of a decoder with one parameter per expert: within each
    layer's experts, expert by expert, gate, up and down."""

    def expert_and_projection(name: str) -> tuple[int, int]:
        m = EXPERT.match(name)
        return int(m.group(2)), PROJECTIONS.index(m.group(3))

    out = {}
    for layer, run in itertools.groupby(tensors, key=lambda n: (m := EXPERT.match(n)) and m.group(1)):
        names = list(run)
        out.update((n, tensors[n]) for n in (sorted(names, key=expert_and_projection) if layer else names))
    return out


def checkpoint_tensors(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Parameters (or their state) by parameter name -> by checkpoint name, views."""
    return {part.name: t.reshape(-1)[part.offset : part.offset + part.numel].view(part.shape)
            for name, t in named.items() for part in checkpoint_parts(name, t.shape)}  # fmt: skip


def module_of(named: dict[str, Tensor]) -> nn.Module:
    """A module whose parameters are ``named``, in that order, under those names."""
    root = nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(t.detach().clone()))
    return root


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return [make_batch(3, seed=1)]


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def test_optimizer_state_of_per_expert_parameters_loads_into_stacked_ones():
    model = initial(moe=True)
    legacy = module_of(per_expert(checkpoint_tensors({n: p for n, p in model.named_parameters()})))
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    for module, named_grads in ((model, grads), (legacy, checkpoint_tensors(grads))):
        opt = adamw(module.parameters())
        for n, p in module.named_parameters():
            p.grad = named_grads[n].clone()
        opt.step()
        module.opt = opt  # (kept for the comparison below)
    store = LocalStore()
    tensors, meta = optimizer_tensors(legacy.opt, legacy)
    assert "state.model.layers.0.mlp.experts.3.up_proj.weight.exp_avg" in tensors
    store.publish("policy.optim", 1, tensors, Kind.OPTIMIZER, meta)
    fresh = adamw(model.parameters())
    load_optimizer_state(store.fetch("policy.optim", 1, Kind.OPTIMIZER), fresh, model)
    for p in model.parameters():
        want, got = model.opt.state[p], fresh.state[p]
        assert float(got["step"]) == float(want["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], want[key])


def _trained(trainer, batch) -> None:
    trainer.load_weights(weights(initial(moe=True)))
    if isinstance(trainer, ShardedTrainer):
        trainer.add(*batch)
    else:
        trainer.accumulate(*batch)
    trainer.step(batch_tokens(batch))


def test_fsdp_rows_of_per_expert_parameters_load_into_stacked_ones(batches):
    """Two ranks' rows of every per-expert tensor (each cut along its own rows) fill one rank's stacked experts."""
    store = LocalStore()
    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        trainer = ShardedTrainer(group, tiny_moe_config(), CFG, 1.0, 0)
        _trained(trainer, batches[0])
        trainer.export_shard(store, "new")
        snap = store.fetch(shard_name("new", 0, 1), 1, Kind.OPTIMIZER)
        step = next(iter(snap.manifest.meta["step"].values()))
        by_key: dict[str, dict[str, Tensor]] = {}
        for key in ("param", "exp_avg", "exp_avg_sq"):
            named = {n.removeprefix(f"{key}."): t for n, t in snap.tensors.items() if n.startswith(f"{key}.")}
            by_key[key] = per_expert(checkpoint_tensors(named))
        names = list(by_key["param"])
        for r in range(2):
            tensors = {f"{key}.{n}": t[slice(*row_range(t.shape[0], r, 2))]
                       for key, named in by_key.items() for n, t in named.items()}  # fmt: skip
            meta = {"rank": r, "world_size": 2, "rows": {n: by_key["param"][n].shape[0] for n in names},
                    "step": dict.fromkeys(names, step)}  # fmt: skip
            store.publish(shard_name("old", r, 2), 1, tensors, Kind.OPTIMIZER, meta)
        for written in ("old", "new"):
            fresh = ShardedTrainer(group, tiny_moe_config(), CFG, 1.0, 0)
            fresh.import_shards(store, written, 1, 2 if written == "old" else 1)
            for (name, p), q in zip(trainer.model.named_parameters(), fresh.model.parameters(), strict=True):
                assert torch.equal(q.to_local(), p.to_local()), (written, name)
                want, got = trainer.trainer.optimizer.state[p], fresh.trainer.optimizer.state[q]
                assert float(got["step"]) == float(want["step"])
                assert torch.equal(got["exp_avg_sq"].to_local(), want["exp_avg_sq"].to_local()), (written, name)
    finally:
        group.leave()


def test_zero_ranges_of_per_expert_parameters_load_into_stacked_ones(batches):
    """Two ranks' ranges of a flat vector laid out expert by expert (gate, up, down) fill one rank's range of the
    vector laid out by stacked parameters."""
    store = LocalStore()
    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:

        def zero() -> ZeroTrainer:
            model = Decoder.empty(tiny_moe_config(), "cpu", torch.float32)
            weights(initial(moe=True)).load_into(model)
            trainer = ZeroTrainer(model, CFG, 1.0, 0)
            trainer.bind(group)
            return trainer

        trainer = zero()
        _trained(trainer, batches[0])
        trainer.export_shard(store, "new")
        snap = store.fetch(shard_name("new", 0, 1), 1, Kind.OPTIMIZER)
        assert snap.manifest.meta["experts"] == "stacked"
        flat = {}
        for key in ("param", "exp_avg", "exp_avg_sq"):
            named = {}
            for (name, p), (lo, hi) in zip(trainer.model.named_parameters(), trainer.spans, strict=True):
                named[name] = snap.tensors[key][lo:hi].view(p.shape)
            flat[key] = torch.cat([t.reshape(-1) for t in per_expert(checkpoint_tensors(named)).values()])
        meta = {k: v for k, v in snap.manifest.meta.items() if k != "experts"}
        for r in range(2):
            lo, hi = row_range(trainer.numel, r, 2)
            tensors = {key: t[lo:hi] for key, t in flat.items()}
            store.publish(shard_name("old", r, 2), 1, tensors, Kind.OPTIMIZER, {**meta, "rank": r, "world_size": 2})
        assert not torch.equal(flat["param"], snap.tensors["param"])  # (another order: the import must map it)
        for written in ("old", "new"):
            fresh = zero()
            fresh.import_shards(store, written, 1, 2 if written == "old" else 1)
            assert torch.equal(fresh.master, trainer.master), written
            assert torch.equal(fresh.moments["exp_avg"], trainer.moments["exp_avg"]), written
            assert fresh.adam_steps == trainer.adam_steps
    finally:
        group.leave()
