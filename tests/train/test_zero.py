"""ZeRO-1 trainer: backward as groups come, alone; the update does not depend on the group or the order.

One spawn of four real processes (gloo on loopback) plays every scenario: groups
of 1, 2 and 3 ranks (a tied-embedding model in the last), two instances of two
devices (each instance's groups cut among its devices), groups handed out
in another order and unevenly (one rank with none), the KL term, bf16
compute, and a membership change 2 -> 3 -> 2 with the train state moving
through the GPS as flat ranges. Each rank backpropagates its groups before it
knows its group (as a device does between its shift and the step), then
meets the others for the step. The tests compare with one plain trainer in
this process, within 1e-5 in fp32.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pivotrl.gps import Kind, LocalStore, Snapshot, module_tensors
from pivotrl.model import Decoder
from pivotrl.train.config import TrainConfig
from pivotrl.train.fsdp import ShardedTrainer
from pivotrl.train.shards import shard_name
from pivotrl.train.zero import ZeroTrainer, check_dtypes
from tests.runtime.ranks import spawn
from tests.train.test_fsdp import (
    CFG,
    KL,
    MODEL,
    TIMEOUT_S,
    FileStore,
    _group,
    _published,
    assert_same_stats,
    config,
    initial,
    one_device,
    weights,
)

# the same scenarios, names and bounds as the FSDP2 trainer's, run here on this module's ranks (``runs``)
from tests.train.test_fsdp import test_kl_against_a_sharded_reference as test_kl_against_the_reference  # noqa: F401, E402
from tests.train.test_fsdp import (  # noqa: F401, E402
    test_membership_change_moves_the_state_through_shards as test_membership_change_moves_the_state_through_ranges,
)
from tests.train.test_replicated import Batch, batch_tokens, instance_share, local_share, make_batch, max_diff


def compute_copy(snap: Snapshot, tied: bool, dtype: torch.dtype = torch.float32) -> Decoder:
    """The weights a device loads at its shift into the train role (the version rollout ran)."""
    model = Decoder.empty(config(tied), "cpu", dtype)
    snap.load_into(model)
    return model


def reversed_share(batch: Batch, world: int, rank: int) -> Batch:
    """Groups dealt the other way round, in reverse order, the last rank given none."""
    samples, advantages = batch
    groups = sorted({s.prompt_index for s in samples}, reverse=True)
    ranks = max(1, world - 1)
    mine = groups[rank::ranks] if rank < ranks else []
    keep = [i for p in mine for i, s in enumerate(samples) if s.prompt_index == p]
    return [samples[i] for i in keep], [advantages[i] for i in keep]


def _worker(rank: int, batches: list[Batch], out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    files = ZeroFiles(out)

    def save(name: str, trainer: ZeroTrainer, stats: list[dict[str, float]]) -> None:
        torch.save({"state": _published(trainer), "stats": stats, "compute": module_tensors(trainer.model)},
                   out / f"{name}.{rank}.pt")  # fmt: skip

    def run(
        name: str, world: int, cfg: TrainConfig, tied: bool = False, bf16: bool = False, share=local_share,
        staged: bool = False,
    ) -> None:  # fmt: skip
        if rank >= world:
            return
        dtype = torch.bfloat16 if bf16 else torch.float32
        snap = weights(initial(tied))
        ref = compute_copy(weights(initial(tied)), tied, dtype).requires_grad_(False) if cfg.kl_coef > 0 else None
        trainer = ZeroTrainer(compute_copy(snap, tied, dtype), cfg, 1.0, 0, ref)
        stats = []
        with _group(rank, world, name, out, staged) as group:
            for i, batch in enumerate(batches[:2]):
                trainer.accumulate(*share(batch, world, rank))  # before the group is known, the first time
                if i == 0:
                    trainer.bind(group)
                    trainer.load_weights(snap)
                stats.append(trainer.step(batch_tokens(batch)).stats)
            save(name, trainer, stats)

    run("w1", 1, CFG)
    run("w2", 2, CFG)
    run("w3", 3, CFG, tied=True)
    run("order", 3, CFG, share=reversed_share)
    run("instances", 4, CFG, share=instance_share)  # two instances of two devices, as the Ray driver deals them
    run("staged", 3, CFG, staged=True)  # the collectives through host memory, as ranks sharing a GPU run them
    run("kl", 2, KL)
    run("bf16", 2, CFG, bf16=True)

    # membership: 2 ranks step v0 -> v1 and write their ranges; 3 ranks read them and step v1 -> v2; then 2 again
    stats: list[dict[str, float]] = []
    trainer = ZeroTrainer(compute_copy(weights(initial()), False), CFG, 1.0, 0)
    if rank < 2:
        with _group(rank, 2, "member-v0", out) as group:
            trainer.accumulate(*local_share(batches[0], 2, rank))
            trainer.bind(group)
            trainer.load_weights(weights(initial()))
            stats.append(trainer.step(batch_tokens(batches[0])).stats)
            if rank == 0:
                files.publish(trainer)
            files.export(trainer)
    for world, old_world, version, batch in ((3, 2, 1, batches[1]), (2, 3, 2, batches[2])):
        if rank >= world:
            continue
        if trainer.version != version:  # a device new to the train role loads the version rollout ran
            trainer = ZeroTrainer(compute_copy(files.weights(version), False), CFG, 1.0, version)
        trainer.detach()
        trainer.accumulate(*local_share(batch, world, rank))
        with _group(rank, world, f"member-v{version}", out) as group:
            trainer.bind(group)
            trainer.import_shards(files.shards(old_world, version), MODEL, version, old_world)
            stats.append(trainer.step(batch_tokens(batch)).stats)
            if rank == 0:
                files.publish(trainer)
            if world == 3:
                files.export(trainer)
            else:
                save("member", trainer, stats)


class ZeroFiles(FileStore):
    """The shared GPS of the membership scenario: shards, and the published weights a new device loads."""

    def publish(self, trainer: ZeroTrainer) -> None:
        path = self.root / f"weights.v{trainer.version}"
        tmp = path.parent / f"{path.name}.tmp"
        torch.save(_published(trainer), tmp)
        tmp.rename(path)

    def weights(self, version: int) -> Snapshot:
        """Version ``version`` once rank 0 has published it (a rank new to the group may come first)."""
        path = self.root / f"weights.v{version}"
        deadline = time.monotonic() + TIMEOUT_S
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        store = LocalStore()
        store.publish(MODEL, version, torch.load(path))
        return store.fetch(MODEL, version)


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return [make_batch(6, seed=1), make_batch(4, seed=2), make_batch(3, seed=3)]


@pytest.fixture(scope="module")
def runs(batches: list[Batch], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    spawn(_worker, (batches, str(out)), 4, out / "marks")
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.0.pt")


@pytest.mark.parametrize(
    ("name", "world", "tied"),
    [
        ("w1", 1, False),
        ("w2", 2, False),
        ("w3", 3, True),
        ("order", 3, False),
        ("staged", 3, False),
        ("instances", 4, False),
    ],  # fmt: skip
)
def test_group_size_and_order_do_not_change_the_update(runs, batches, name, world, tied):
    state, stats = one_device(batches[:2], tied=tied)
    got = load(runs, name)
    assert max_diff(got["state"], state) < 1e-5
    assert max_diff(got["compute"], state) < 1e-5  # every rank's compute copy is the new version
    assert max_diff(state, module_tensors(initial(tied))) > 3e-4  # a real update (2 steps of lr 3e-4)
    for got_step, want_step in zip(got["stats"], stats, strict=True):
        assert_same_stats(got_step, want_step)
        assert got_step["world_size"] == world
    assert [s["version"] for s in got["stats"]] == [1.0, 2.0]


def test_bf16_compute_updates_fp32_master_weights_close_to_fp32(runs, batches):
    state, _ = one_device(batches[:2])
    got = load(runs, "bf16")
    assert all(t.dtype == torch.float32 for t in got["state"].values())  # published from the fp32 master
    assert all(t.dtype == torch.bfloat16 for t in got["compute"].values())
    assert 0 < max_diff(got["state"], state) < 2e-2  # bf16 rounding shows, but it is the same update


def test_gradients_sum_in_fp32_as_they_come(batches):
    """Each backward's gradient is added into the float32 buffer and dropped from the parameter."""
    trainer = ZeroTrainer(compute_copy(weights(initial()), False), CFG, 1.0, 0)
    trainer.accumulate(*local_share(batches[0], 2, 0))
    assert all(p.grad is None for p in trainer.model.parameters())
    first = trainer.grads.clone()
    assert first.abs().sum() > 0
    trainer.accumulate(*local_share(batches[0], 2, 1))
    plain = initial()
    from pivotrl.train.grpo import GRPOTrainer

    ref = GRPOTrainer(plain, CFG)
    ref.accumulate(*local_share(batches[0], 2, 0))
    ref.accumulate(*local_share(batches[0], 2, 1))
    want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    assert torch.equal(trainer.grads[: want.numel()], want)


def test_a_released_trainer_frees_its_weights_and_gradient_sum(batches):
    """The gradient hooks live on the parameters, out of the collector's sight: a trainer they held would never
    be freed, and on a GPU its weights and fp32 gradient sum would stay after every shift out of the role."""
    import gc
    import weakref

    trainer = ZeroTrainer(compute_copy(weights(initial()), False), CFG, 1.0, 0)
    trainer.accumulate(*local_share(batches[0], 2, 0))
    gone, model, grads = weakref.ref(trainer), weakref.ref(trainer.model), weakref.ref(trainer.grads)
    gc.disable()  # (freed as the last reference goes, not when a collection happens to run)
    try:
        del trainer
        assert gone() is None and model() is None and grads() is None
    finally:
        gc.enable()


def test_shards_of_another_trainer_are_refused(batches):
    """Resuming with another train.backend than the one that wrote the state: one clear error."""
    store = LocalStore()
    from pivotrl.train.group import TrainGroup

    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        fsdp = ShardedTrainer(group, config(), CFG, 1.0, 0)
        fsdp.load_weights(weights(initial()))
        fsdp.export_shard(store, MODEL)
        zero = ZeroTrainer(compute_copy(weights(initial()), False), CFG, 1.0, 0)
        zero.bind(group)
        with pytest.raises(ValueError, match="train.backend that wrote it"):
            zero.import_shards(store, MODEL, 0, 1)
        assert store.versions(shard_name(MODEL, 0, 1), Kind.OPTIMIZER) == [0]
    finally:
        group.leave()


def test_fp32_compute_from_bf16_rollout_weights_is_refused():
    with pytest.raises(ValueError, match="train.precision=bf16, or policy.rollout_dtype=float32"):
        check_dtypes(torch.float32, torch.bfloat16)
    check_dtypes(torch.bfloat16, torch.bfloat16)
    check_dtypes(torch.bfloat16, torch.float32)
    check_dtypes(torch.float32, torch.float32)


def test_adamw_by_chunks_is_torch_adamw(monkeypatch):
    """The range's AdamW, chunk by chunk, is torch's AdamW element by element (weight decay on, three steps)."""
    import pivotrl.train.zero as zero

    monkeypatch.setattr(zero, "CHUNK", 7)
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.95, eps=1e-6)
    trainer = ZeroTrainer(compute_copy(weights(initial()), False), cfg, 1.0, 0)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen)
    trainer._new_master(start.clone(), None, None)
    plain = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([plain], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)  # fmt: skip
    for _ in range(3):
        grad = torch.randn(50, generator=gen)
        trainer._adamw(grad.clone())
        plain.grad = grad
        opt.step()
    assert torch.equal(trainer.master, plain.detach())
    assert torch.equal(trainer.moments["exp_avg_sq"], opt.state[plain]["exp_avg_sq"])


def test_weights_are_published_from_the_step_they_come_from(batches):
    """The published version is the gathered fp32 master weights of the step just taken; once a backward has
    cleared them, publishing is a mistake, not a quiet copy of the compute weights."""
    trainer = ZeroTrainer(compute_copy(weights(initial()), False), CFG, 1.0, 0)
    trainer.accumulate(*batches[0])
    with pytest.raises(RuntimeError, match="right after step"):
        trainer.publish_weights(LocalStore(), MODEL, torch.float32, {})


def test_experts_load_and_publish_under_checkpoint_names(batches):
    """A mixture-of-experts model's stacked experts take their master range from the per-expert tensors of a
    published version and publish them back under those names: one rank's step is the plain trainer's."""
    from pivotrl.train.group import TrainGroup

    start = weights(initial(moe=True))
    assert "model.layers.0.mlp.experts.15.up_proj.weight" in start.tensors
    model = Decoder.empty(config(moe=True), "cpu", torch.float32)
    start.load_into(model)
    trainer = ZeroTrainer(model, CFG, 1.0, 0)
    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        trainer.bind(group)
        trainer.load_weights(start)
        trainer.accumulate(*batches[0])
        trainer.step(batch_tokens(batches[0]))
        store = LocalStore()
        trainer.publish_weights(store, MODEL, torch.float32, {})
        got = store.fetch(MODEL, 1).state_dict(copy=True)
    finally:
        group.leave()
    want, _ = one_device(batches[:1], moe=True)
    assert got.keys() == want.keys()
    assert max_diff(got, want) < 1e-5
    assert max_diff(want, module_tensors(initial(moe=True))) > 3e-4
