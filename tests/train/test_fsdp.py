"""Sharded (FSDP2) trainer: the update does not depend on how many ranks hold the shards.

One spawn of four real processes (gloo on loopback) plays every scenario in
turn: groups of 1, 2 and 3 ranks, two instances of two devices (each
instance's groups cut among its devices, a group maybe across two, as the Ray
driver deals them), a membership change 2 -> 3 -> 2 with the
train state moving through the GPS as shards, a tied-embedding model, the KL
term against a sharded reference, bf16 compute, and a mixture-of-experts
model (ranks whose tokens leave different experts unchosen), half of each batch
backpropagated ahead of the step, and a step begun by 2 ranks and finished by
3 (the gradient sums moving through the GPS). Each rank writes what it
got to a file; the tests compare with one plain, unsharded trainer in this
process, within 1e-5 in fp32.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pivotrl.gps import Kind, LocalStore, Snapshot, VersionError, module_tensors
from pivotrl.model import Decoder, ModelConfig
from pivotrl.train.config import TrainConfig
from pivotrl.train.fsdp import ShardedTrainer, balance
from pivotrl.train.group import TrainGroup, listen
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.shards import row_range, shard_name
from tests.conftest import tiny_config, tiny_moe_config
from tests.runtime.ranks import spawn
from tests.train.test_replicated import (
    STAT_KEYS,
    Batch,
    G,
    batch_tokens,
    instance_share,
    local_share,
    make_batch,
    max_diff,
)
from tests.train.test_replicated import assert_same_stats as same_stats

MODEL = "policy"
CFG = TrainConfig(micro_batch=5, micro_batch_tokens=40, grad_clip=0.5)  # cuts by count and by tokens; clip active
KL = TrainConfig(micro_batch=5, grad_clip=0.5, kl_coef=0.1)
TIMEOUT_S = 60.0
Share = Callable[[Batch, int, int], Batch]  # a rank's part of a batch: (batch, world size, rank)


def config(tied: bool = False, moe: bool = False) -> ModelConfig:
    return tiny_moe_config() if moe else tiny_config(tied=tied)


def initial(tied: bool = False, seed: int = 0, moe: bool = False) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(config(tied, moe)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms and biases off their defaults, so every row matters
    return model


def weights(model: Decoder) -> Snapshot:
    store = LocalStore()
    store.publish(MODEL, 0, module_tensors(model))
    return store.fetch(MODEL, 0)


class FileStore:
    """Stand-in for a GPS shared between processes (a RayStore in the runtime): shards go through files."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def export(self, trainer: ShardedTrainer) -> None:
        """Write this rank's shard of the trainer's version (it exists once the next group has met)."""
        local = LocalStore()
        partial = getattr(trainer, "mid_step", False)  # (the ZeRO-1 trainer's tests write their shards here too)
        trainer.export_shard(local, MODEL, **({"partial": True} if partial else {}))
        name, version = shard_name(MODEL, trainer.rank, trainer.group.world_size, partial), trainer.version
        snap = local.fetch(name, version, Kind.OPTIMIZER)
        tmp = self.root / f"{name}.v{version}.tmp"
        tmp.write_bytes(pickle.dumps((snap.manifest, snap.buffer)))
        tmp.rename(self.root / f"{name}.v{version}")

    def shards(self, world: int, version: int, partial: bool = False) -> LocalStore:
        """A store holding every shard a group of ``world`` wrote for ``version``."""
        store = LocalStore()
        for r in range(world):
            name = shard_name(MODEL, r, world, partial)
            manifest, buffer = pickle.loads((self.root / f"{name}.v{version}").read_bytes())
            snap = Snapshot.of(manifest, buffer)
            store.publish(name, version, snap.tensors, Kind.OPTIMIZER, manifest.meta)
        return store


def _group(rank: int, world: int, name: str, out: Path, staged: bool = False) -> TrainGroup:
    """Rank 0 listens on a port the system picks and tells it through a file (the driver's part in the
    runtime); a port found free beforehand could be taken by any other socket in between. ``staged``: the
    collectives copy through host memory, as ranks sharing a GPU do."""
    if world == 1:
        return TrainGroup.join(0, 1, device="cpu", process_group=True, staged=staged)
    told = out / f"{name}.port"
    if rank == 0:
        store = listen(world, timeout_s=TIMEOUT_S)
        told.with_suffix(".tmp").write_text(str(store.port))
        told.with_suffix(".tmp").rename(told)
        return TrainGroup.join(
            0, world, device="cpu", timeout_s=TIMEOUT_S, store=store, process_group=True, staged=staged
        )
    deadline = time.monotonic() + TIMEOUT_S
    while not told.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    port = int(told.read_text())
    return TrainGroup.join(
        rank, world, master_port=port, device="cpu", timeout_s=TIMEOUT_S, process_group=True, staged=staged
    )


def _step(trainer: ShardedTrainer, batch: Batch, share: Share = local_share) -> dict[str, float]:
    trainer.add(*share(batch, trainer.group.world_size, trainer.rank))
    result = trainer.step(batch_tokens(batch))
    assert result.tokens > 0 and result.backward_s > 0
    return result.stats


def _published(trainer: ShardedTrainer) -> dict[str, torch.Tensor]:
    store = LocalStore()
    trainer.publish_weights(store, MODEL, torch.float32, {})
    if trainer.rank != 0:
        return {}
    return store.fetch(MODEL, trainer.version).state_dict(copy=True)


def _worker(rank: int, batches: list[Batch], out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    files = FileStore(out)

    def save(name: str, trainer: ShardedTrainer, stats: list[dict[str, float]]) -> None:
        state = _published(trainer)  # a collective: every rank of the group takes part
        torch.save({"state": state, "stats": stats}, out / f"{name}.{rank}.pt")

    def run(
        name: str, world: int, cfg: TrainConfig, tied: bool = False, bf16: bool = False, moe: bool = False,
        share: Share = local_share,
    ) -> None:  # fmt: skip
        if rank >= world:
            return
        with _group(rank, world, name, out) as group:
            ref = weights(initial(tied)) if cfg.kl_coef > 0 else None
            dtype = torch.bfloat16 if bf16 else torch.float32
            trainer = ShardedTrainer(group, config(tied, moe), cfg, 1.0, 0, dtype, ref)
            trainer.load_weights(weights(initial(tied, moe=moe)))
            stats = [_step(trainer, b, share) for b in batches[:2]]
            save(name, trainer, stats)

    run("w1", 1, CFG)
    run("w2", 2, CFG)
    run("w3", 3, CFG, tied=True)
    run("kl", 2, KL)
    run("bf16", 2, CFG, bf16=True)
    run("moe", 2, CFG, moe=True)
    run("instances", 4, CFG, share=instance_share)  # two instances of two devices

    # a backward ahead of the step: 2 ranks backpropagate half the batch, buffer the rest, then step
    if rank < 2:
        with _group(rank, 2, "ahead", out) as group:
            trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
            trainer.load_weights(weights(initial()))
            stats = []
            for b in batches[:2]:
                first, second = halves(b)
                trainer.add(*local_share(first, 2, rank))
                tokens, seconds = trainer.backward_pending()
                assert tokens > 0 and seconds > 0 and trainer.mid_step
                trainer.add(*local_share(second, 2, rank))
                stats.append(trainer.step(batch_tokens(b)).stats)
            save("ahead", trainer, stats)

    # ... and the step finished by another group: 2 ranks backpropagate half the batch and leave (their shards
    # with the gradient sums, under the partial names), 3 ranks take them up, add the rest and step
    if rank < 2:
        with _group(rank, 2, "moved-v0", out) as group:
            trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
            trainer.load_weights(weights(initial()))
            first, _ = halves(batches[0])
            trainer.add(*local_share(first, 2, rank))
            trainer.backward_pending()
            files.export(trainer)
    if rank < 3:
        with _group(rank, 3, "moved", out) as group:
            trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
            trainer.import_shards(files.shards(2, 0, partial=True), MODEL, 0, 2, partial=True)
            assert trainer.mid_step and bool(trainer.partial) == (rank == 0)
            _, second = halves(batches[0])
            trainer.add(*local_share(second, 3, rank))
            save("moved", trainer, [trainer.step(batch_tokens(batches[0])).stats])

    # membership: 2 ranks step v0 -> v1, write shards; 3 ranks read them and step v1 -> v2; 2 ranks again for v3
    stats: list[dict[str, float]] = []
    if rank < 2:
        with _group(rank, 2, "member-v0", out) as group:
            trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
            trainer.load_weights(weights(initial()))
            stats.append(_step(trainer, batches[0]))
            files.export(trainer)
    for world, old_world, version, batch in ((3, 2, 1, batches[1]), (2, 3, 2, batches[2])):
        if rank >= world:
            continue
        with _group(rank, world, f"member-v{version}", out) as group:
            trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
            trainer.import_shards(files.shards(old_world, version), MODEL, version, old_world)
            stats.append(_step(trainer, batch))
            if world == 3:
                files.export(trainer)
            else:
                save("member", trainer, stats)


def halves(batch: Batch) -> tuple[Batch, Batch]:
    """The batch's first groups and the rest (whole groups each)."""
    samples, advantages = batch
    cut = len(samples) // 2 // G * G
    return (samples[:cut], advantages[:cut]), (samples[cut:], advantages[cut:])


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return [make_batch(6, seed=1), make_batch(4, seed=2), make_batch(3, seed=3)]


@pytest.fixture(scope="module")
def runs(batches: list[Batch], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    spawn(_worker, (batches, str(out)), 4, out / "marks")
    return out


def one_device(batches: list[Batch], cfg: TrainConfig = CFG, tied: bool = False, moe: bool = False):
    ref = initial(tied).requires_grad_(False) if cfg.kl_coef > 0 else None
    trainer = GRPOTrainer(initial(tied, moe=moe), cfg, ref_model=ref)
    stats = [trainer.train_batch(*b) for b in batches]
    return module_tensors(trainer.model), stats


def assert_same_stats(got: dict[str, float], want: dict[str, float]) -> None:
    same_stats(got, want, STAT_KEYS)  # (the plain trainer reports no version)


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.0.pt")


@pytest.mark.parametrize(
    ("name", "world", "tied"), [("w1", 1, False), ("w2", 2, False), ("w3", 3, True), ("instances", 4, False)]
)
def test_world_size_does_not_change_the_update(runs, batches, name, world, tied):
    state, stats = one_device(batches[:2], tied=tied)
    got = load(runs, name)
    assert max_diff(got["state"], state) < 1e-5
    assert max_diff(state, module_tensors(initial(tied))) > 3e-4  # a real update (2 steps of lr 3e-4): 30x the bound
    for got_step, want_step in zip(got["stats"], stats, strict=True):
        assert_same_stats(got_step, want_step)
        assert got_step["world_size"] == world
    assert [s["version"] for s in got["stats"]] == [1.0, 2.0]


def test_experts_train_sharded_as_on_one_device(runs, batches):
    """Every expert holds a gradient on every rank (zero where its tokens went elsewhere), so FSDP2's
    reduce-scatter sees the same parameters on each rank and the update is the one-device update."""
    state, stats = one_device(batches[:2], moe=True)
    got = load(runs, "moe")
    assert max_diff(got["state"], state) < 1e-5
    assert max_diff(state, module_tensors(initial(moe=True))) > 3e-4
    for got_step, want_step in zip(got["stats"], stats, strict=True):
        assert_same_stats(got_step, want_step)


def test_membership_change_moves_the_state_through_shards(runs, batches):
    state, stats = one_device(batches)
    got = load(runs, "member")
    assert max_diff(got["state"], state) < 1e-5
    for got_step, want_step in zip(got["stats"], stats, strict=True):
        assert_same_stats(got_step, want_step)
    assert [s["world_size"] for s in got["stats"]] == [2.0, 3.0, 2.0]


def test_a_backward_ahead_of_the_step_gives_the_same_update(runs, batches):
    """Half of each batch backpropagated before the rest arrives, in lockstep: the step divides the sums of
    both backwards, so the update is the one-device update of the whole batch, and so are the numbers."""
    state, stats = one_device(batches[:2])
    got = load(runs, "ahead")
    assert max_diff(got["state"], state) < 1e-5
    for got_step, want_step in zip(got["stats"], stats, strict=True):
        assert_same_stats(got_step, want_step)


def test_a_step_taken_up_by_another_group_gives_the_same_update(runs, batches):
    """Two ranks backpropagate half the batch and leave; three take their shards up, gradient sums and loss
    sums with them, add the rest and step: the one-device update of the whole batch."""
    state, stats = one_device(batches[:1])
    got = load(runs, "moved")
    assert max_diff(got["state"], state) < 1e-5
    assert_same_stats(got["stats"][0], stats[0])
    assert got["stats"][0]["world_size"] == 3


def test_gradients_leave_a_device_only_as_a_step_taken_up_elsewhere():
    """Gradient sums held (a backward ahead of the step) are written only when asked for as a partial state,
    under a name of their own; a plain export refuses them, as it does after a step broken off, and so does a
    checkpoint copy; a trainer holding gradients takes up no other state."""
    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        snap = weights(initial())
        trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
        trainer.load_weights(snap)
        batch = make_batch(2, 0)
        trainer.add(*local_share(batch, 1, 0))
        store = LocalStore()
        with pytest.raises(RuntimeError, match="buffered samples"):
            trainer.export_shard(store, MODEL, partial=True)
        trainer.backward_pending()
        assert trainer.mid_step and trainer.partial["tokens"] == batch_tokens(batch)
        with pytest.raises(RuntimeError, match="gradients held"):
            trainer.export_shard(store, MODEL)
        with pytest.raises(RuntimeError, match="checkpoint copy"):
            trainer.export_shard(store, "copy", leaving=False, partial=True)
        assert trainer.export_shard(store, MODEL, partial=True) > 0
        written = store.fetch(shard_name(MODEL, 0, 1, partial=True), 0, Kind.OPTIMIZER)
        assert any(k.startswith("grad.") for k in written.tensors) and written.manifest.meta["partial"]
        with pytest.raises(VersionError):  # (the whole state of v0 was not written: only the partial one)
            store.fetch(shard_name(MODEL, 0, 1), 0, Kind.OPTIMIZER)
        with pytest.raises(RuntimeError, match="holding samples or gradients"):
            trainer.import_shards(store, MODEL, 0, 1, partial=True)
    finally:
        group.leave()


def test_kl_against_a_sharded_reference(runs, batches):
    state, stats = one_device(batches[:2], KL)
    got = load(runs, "kl")
    assert max_diff(got["state"], state) < 1e-5
    assert got["stats"][1]["kl"] == pytest.approx(stats[1]["kl"], rel=1e-5, abs=1e-7)
    assert got["stats"][1]["kl"] > 0  # the second step moved away from the reference


def test_the_reference_keeps_no_whole_weights_after_its_forward():
    """The KL reference only runs forward: its root (embedding, head, final norm) is resharded after it, as each
    layer is, instead of staying gathered for a backward that never comes."""
    from torch.distributed.tensor import DTensor

    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        snap = weights(initial())
        trainer = ShardedTrainer(group, tiny_config(), KL, 1.0, 0, reference=snap)
        trainer.load_weights(snap)
        batch = make_batch(2, 0)
        trainer.add(*local_share(batch, 1, 0))
        trainer.step(batch_tokens(batch))
        ref = trainer.trainer.ref_model
        for p in (ref.model.embed_tokens.weight, ref.lm_head.weight, ref.model.norm.weight):
            assert isinstance(p, DTensor)
    finally:
        group.leave()


def test_publish_gathers_every_parameter_even_when_the_store_refuses(monkeypatch):
    """Rank 0 copies each gathered parameter into the GPS's buffer as it comes, so a store that refuses the
    version (it exists) does so before the gathers: rank 0 still takes part in every one, as the other ranks
    do, and then raises. Published, the weights are the trainer's, cast."""
    group = TrainGroup.join(0, 1, device="cpu", process_group=True)
    try:
        snap = weights(initial())
        trainer = ShardedTrainer(group, tiny_config(), CFG, 1.0, 0)
        trainer.load_weights(snap)
        marks = []
        monkeypatch.setattr(TrainGroup, "mark", lambda self: marks.append(1))
        store = LocalStore()
        assert trainer.publish_weights(store, MODEL, torch.bfloat16, {}) > 0
        params = len(list(trainer.model.parameters()))
        assert len(marks) == params
        got = store.fetch(MODEL, trainer.version).tensors
        for name, t in snap.tensors.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16))
        marks.clear()
        with pytest.raises(VersionError):
            trainer.publish_weights(store, MODEL, torch.bfloat16, {})  # the version is there already
        assert len(marks) == params
    finally:
        group.leave()


def test_bf16_compute_updates_fp32_master_weights_close_to_fp32(runs, batches):
    state, _ = one_device(batches[:2])
    got = load(runs, "bf16")
    assert all(t.dtype == torch.float32 for t in got["state"].values())
    diff = max_diff(got["state"], state)
    assert 0 < diff < 2e-2  # bf16 rounding shows, but it is the same update


@pytest.mark.parametrize(
    ("rows", "world", "want"),
    [
        (8, 2, [(0, 4), (4, 8)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (4, 3, [(0, 2), (2, 4), (4, 4)]),  # torch.chunk leaves the last rank empty
        (1, 2, [(0, 1), (1, 1)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_row_range_cuts_as_torch_chunk(rows, world, want):
    assert [row_range(rows, r, world) for r in range(world)] == want
    chunks = torch.arange(rows).chunk(world)
    got = [torch.arange(rows)[a:b] for a, b in want]
    assert all(torch.equal(c, g) for c, g in zip(chunks, got, strict=False))


@pytest.mark.parametrize(
    ("lengths", "world", "want"),
    [
        ([5, 5, 5, 5], 2, [[0, 2], [1, 3]]),
        ([9, 1, 1, 1, 6], 2, [[0], [4, 1, 2, 3]]),
        ([3], 3, [[0], [], []]),
        ([], 2, [[], []]),
    ],
)
def test_balance_deals_longest_first_to_the_least_loaded(lengths, world, want):
    assert balance(lengths, world) == want
