"""Elastic trainer: the policy after a step does not depend on how many ranks trained it.

One spawn of three real processes (gloo on loopback) plays every multi-rank
scenario in turn, so the processes also prove that a process can leave a
train group and join the next one, six times over. Each rank writes its final
weights and step stats to a file; the tests compare them with one-rank
training in this process.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pivotrl.control.messages import TrainShard
from pivotrl.gps import Kind, LocalStore, Snapshot, module_tensors
from pivotrl.model import Decoder
from pivotrl.runtime.instances import split_shard
from pivotrl.sample import Sample
from pivotrl.train.advantages import group_advantages
from pivotrl.train.config import TrainConfig
from pivotrl.train.group import ARRIVED, JoinAbandoned, RendezvousGone, TrainGroup, backend_for, listen
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.loss import token_logprobs
from pivotrl.train.replicated import ElasticTrainer
from tests.conftest import tiny_config
from tests.runtime.ranks import spawn
from tests.train.test_grpo import G, make_sample

MODEL = "policy"
CFG = TrainConfig(micro_batch=5, grad_clip=0.5)  # micro-batches cut across groups; the clip is active
TIMEOUT_S = 60.0  # a hung rendezvous fails the test instead of hanging it
Batch = tuple[list[Sample], list[float]]


def tiny_model(seed: int = 0, frozen: bool = False) -> Decoder:
    """``frozen``: the final norm gets no gradient on any rank, which must leave it out of AdamW as on one rank."""
    torch.manual_seed(seed)
    cfg = tiny_config()
    model = Decoder(cfg).eval()
    model.model.norm.weight.requires_grad_(not frozen)
    return model


def make_batch(num_groups: int, seed: int) -> Batch:
    """Random prompts and responses, with rollout log-probs perturbed off the model's so that clipping is active."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny_model()
    samples, rewards = [], []
    for uid in range(num_groups * G):
        prompt = torch.randint(1, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        response = torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([prompt + response]))[0, len(prompt) - 1 :]
        lp = lp + 0.4 * torch.randn(lp.shape, generator=gen)
        samples.append(make_sample(uid, prompt, response, lp.tolist()))
        rewards.append(float(torch.rand((), generator=gen) < 0.5))
    return samples, group_advantages(rewards, G)


def local_share(batch: Batch, world_size: int, rank: int) -> Batch:
    """A rank's whole groups of ``batch`` (a whole batch or any part of one), round-robin."""
    samples, advantages = batch
    mine = set(sorted({s.prompt_index for s in samples})[rank::world_size])
    keep = [i for i, s in enumerate(samples) if s.prompt_index in mine]
    return [samples[i] for i in keep], [advantages[i] for i in keep]


def instance_share(batch: Batch, world_size: int, rank: int, size: int = 2) -> Batch:
    """A rank's part of ``batch`` where ``world_size`` ranks are instances of ``size`` devices, as the Ray driver
    deals a step: each instance its whole groups, round-robin (the control plane's device is the instance), cut
    among the instance's devices into consecutive runs of samples by ``split_shard``, a group maybe across two."""
    samples, advantages = local_share(batch, world_size // size, rank // size)
    shard = TrainShard(
        prompt_ids=tuple(s.prompt_ids for s in samples),
        response_ids=tuple(s.response_ids for s in samples),
        logprobs=tuple(s.logprobs for s in samples),
        advantages=tuple(advantages),
    )
    parts = split_shard(shard, size)
    lo = sum(len(p.advantages) for p in parts[: rank % size])
    hi = lo + len(parts[rank % size].advantages)
    return samples[lo:hi], advantages[lo:hi]


def batch_tokens(batch: Batch) -> int:
    return sum(len(s.response_ids) for s in batch[0])


def train_step(trainer: ElasticTrainer, batch: Batch, known_total: bool) -> dict[str, float]:
    group = trainer.group
    trainer.accumulate(*local_share(batch, group.world_size, group.rank))
    return trainer.step(batch_tokens(batch) if known_total else None).stats


def snapshot(trainer: ElasticTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module_tensors(trainer.model).items()}


# --- the three ranks ------------------------------------------------------------------------------------------------


def _join(rank: int, world_size: int, port: int) -> TrainGroup:
    return TrainGroup.join(rank, world_size, master_port=port, device="cpu", timeout_s=TIMEOUT_S)


def _carry(path: Path, store: LocalStore | None = None) -> LocalStore:
    """Stand-in for a GPS shared between processes (a RayStore in the runtime): write out, or read into a store."""
    if store is not None:
        snaps = [store.fetch(MODEL, 1, kind) for kind in Kind]
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps([(s.manifest, s.buffer) for s in snaps]))
        tmp.rename(path)
        return store
    store = LocalStore()
    for manifest, buffer in pickle.loads(path.read_bytes()):
        snap = Snapshot.of(manifest, buffer)
        store.publish(MODEL, manifest.version, snap.tensors, manifest.kind, manifest.meta)
    return store


def _worker(rank: int, ports: list[int], batches: list[Batch], out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)

    def save(name: str, trainer: ElasticTrainer, stats: list[dict[str, float]]) -> None:
        frozen = trainer.model.model.norm.weight
        result = {
            "state": snapshot(trainer),
            "stats": stats,
            "frozen": (frozen.grad, trainer.trainer.optimizer.state[frozen]),
        }
        torch.save(result, out / f"{name}.{rank}.pt")

    # world 2 (rank 2 sits this one out), total_tokens given by the caller
    if rank < 2:
        with _join(rank, 2, ports[0]) as group:
            trainer = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), group)
            stats = [train_step(trainer, b, known_total=True) for b in batches[:2]]
        save("w2", trainer, stats)

    # world 3, total_tokens left to the group's own count
    with _join(rank, 3, ports[1]) as group:
        trainer = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), group)
        stats = [train_step(trainer, b, known_total=False) for b in batches[:2]]
    save("w3", trainer, stats)

    # membership change: ranks 0 and 1 train step 1, then rank 2 takes up the train role from the GPS for step 2
    handoff = out / "handoff.pkl"
    if rank < 2:
        with _join(rank, 2, ports[2]) as group:
            trainer = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), group)
            stats = [train_step(trainer, batches[0], known_total=True)]
        if rank == 0:
            store = LocalStore()
            trainer.export_state(store, MODEL)
            _carry(handoff, store)  # written before joining the next epoch, so it exists once everyone has joined
    with _join(rank, 3, ports[3]) as group:
        if rank == 2:
            trainer = ElasticTrainer(GRPOTrainer(tiny_model(seed=1), CFG), group)  # other weights: only import helps
            trainer.import_state(_carry(handoff), MODEL, version=1)
            stats = [{}]
        else:
            trainer.group = group
        stats.append(train_step(trainer, batches[1], known_total=True))
    save("member", trainer, stats)

    # world 3 on a batch of two groups: rank 2 gets none and still takes part; one parameter has no gradient anywhere
    with _join(rank, 3, ports[4]) as group:
        trainer = ElasticTrainer(GRPOTrainer(tiny_model(frozen=True), CFG), group)
        stats = [train_step(trainer, batches[2], known_total=True)]
    save("empty", trainer, stats)

    # a rank that joins without importing the state: every rank refuses the step, none hangs
    if rank < 2:
        with _join(rank, 2, ports[5]) as group:
            trainer = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), group, version=0 if rank else 3)
            try:
                train_step(trainer, batches[0], known_total=True)
                error = ""
            except RuntimeError as e:
                error = str(e)
        (out / f"mismatch.{rank}.txt").write_text(error)


def free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return [make_batch(6, seed=1), make_batch(4, seed=2), make_batch(2, seed=3)]


@pytest.fixture(scope="module")
def runs(batches: list[Batch], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist_train")
    spawn(_worker, (free_ports(6), batches, str(out)), 3, out / "marks")
    return out


def one_rank(batches: list[Batch], frozen: bool = False) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    trainer = ElasticTrainer(GRPOTrainer(tiny_model(frozen=frozen), CFG))
    stats = [train_step(trainer, b, known_total=True) for b in batches]
    return snapshot(trainer), stats


@pytest.fixture(scope="module")
def reference(batches: list[Batch]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    return one_rank(batches[:2])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


STAT_KEYS = ("tokens", "loss", "pg_loss", "clip_frac", "grad_norm", "ratio_max", "ratio_min")


def assert_same_stats(
    got: dict[str, float], want: dict[str, float], keys: tuple[str, ...] = (*STAT_KEYS, "version")
) -> None:
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def load(runs: Path, name: str, rank: int) -> dict:
    return torch.load(runs / f"{name}.{rank}.pt")


# --- tests ------------------------------------------------------------------------------------------------------------


def test_reference_is_a_meaningful_update(reference):
    state, stats = reference
    assert max_diff(state, module_tensors(tiny_model())) > 1e-4  # weights moved well beyond the tolerance
    assert all(s["clip_frac"] > 0 for s in stats)  # the clipped branch of the loss is exercised
    assert all(s["grad_norm"] > CFG.grad_clip for s in stats)  # and so is gradient clipping


@pytest.mark.parametrize(("name", "world_size"), [("w2", 2), ("w3", 3)])
def test_world_size_does_not_change_the_update(runs, reference, name, world_size):
    state, stats = reference
    for rank in range(world_size):
        got = load(runs, name, rank)
        assert max_diff(got["state"], state) < 1e-5, f"rank {rank}"
        for got_step, want_step in zip(got["stats"], stats, strict=True):
            assert_same_stats(got_step, want_step)
            assert got_step["world_size"] == world_size


def test_membership_change_between_steps_matches_one_rank(runs, reference):
    state, stats = reference
    for rank in range(3):
        got = load(runs, "member", rank)
        assert max_diff(got["state"], state) < 1e-5, f"rank {rank}"
        assert_same_stats(got["stats"][-1], stats[-1])
        assert got["stats"][-1]["world_size"] == 3


def test_rank_without_samples_takes_part(runs, batches):
    state, stats = one_rank(batches[2:], frozen=True)
    for rank in range(3):
        got = load(runs, "empty", rank)
        assert max_diff(got["state"], state) < 1e-5, f"rank {rank}"
        assert_same_stats(got["stats"][0], stats[0])
        assert got["frozen"] == (None, {})  # no zero gradient made up for it, so AdamW never touched it


def test_replica_at_another_version_fails_the_step_on_every_rank(runs):
    for rank in range(2):
        assert "different policy versions [3, 0]" in (runs / f"mismatch.{rank}.txt").read_text()


def test_one_rank_makes_no_distributed_calls_and_equals_plain_grpo(batches, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("world size 1 must not touch torch.distributed")

    for name in ("init_process_group", "destroy_process_group", "all_reduce", "all_gather", "is_initialized"):
        monkeypatch.setattr(dist, name, forbidden)
    with _join(0, 1, 0) as group:
        elastic = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), group)
        plain = GRPOTrainer(tiny_model(), CFG)
        for batch in batches[:2]:
            elastic.accumulate(*batch)
            assert elastic.global_tokens() == batch_tokens(batch)
            got = elastic.step().stats
            want = plain.train_batch(*batch)
            assert got == want | {"world_size": 1.0, "version": got["version"]}
    assert elastic.version == 2
    assert max_diff(snapshot(elastic), module_tensors(plain.model)) == 0.0


def test_export_import_hands_the_train_role_over(batches):
    store = LocalStore()
    old = ElasticTrainer(GRPOTrainer(tiny_model(), CFG), _join(0, 1, 0), version=5)
    train_step(old, batches[0], known_total=True)
    old.accumulate(*batches[1])
    with pytest.raises(RuntimeError, match="accumulated gradients"):
        old.export_state(store, MODEL)
    old.step()
    assert old.export_state(store, MODEL) > 0
    assert store.versions(MODEL, Kind.WEIGHTS) == store.versions(MODEL, Kind.OPTIMIZER) == [7]

    new = ElasticTrainer(GRPOTrainer(tiny_model(seed=1), CFG), _join(0, 1, 0))
    new.import_state(store, MODEL, 7)
    assert new.version == 7
    for trainer in (old, new):
        train_step(trainer, batches[2], known_total=True)
    assert max_diff(snapshot(old), snapshot(new)) == 0.0
    assert new.version == old.version == 8


def test_backend_for_names_one_backend_per_device_type():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="supported: cuda, cpu"):
        backend_for(torch.device("meta"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 0, "world_size": 2}, "master_port"),
        ({"rank": 0, "world_size": 2, "master_port": 1234, "timeout_s": 0}, "timeout_s"),
    ],
)
def test_train_group_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainGroup.join(device="cpu", **kwargs)


def _listening(rank: int, out_dir: str) -> None:
    """Rank 0 binds its port before telling it (a file stands in for the driver); the other meets it there."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    if rank == 0:
        store = listen(2, timeout_s=TIMEOUT_S)
        (out / "port.tmp").write_text(str(store.port))
        (out / "port.tmp").rename(out / "port")
        group = TrainGroup.join(0, 2, device="cpu", timeout_s=TIMEOUT_S, store=store)
    else:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        port = int((out / "port").read_text())
        group = TrainGroup.join(1, 2, master_port=port, device="cpu", timeout_s=TIMEOUT_S, listening=True)
    with group:
        total = group.all_reduce_(torch.tensor([rank + 1.0]))
        stacked = group.all_gather(torch.tensor([rank]))
    (out / f"sum.{rank}").write_text(str(total.item()))
    (out / f"marks.{rank}").write_text(f"{group.marks} {stacked.flatten().tolist()}")


def test_rank_zero_listens_on_a_port_it_holds_and_the_others_meet_it_there(tmp_path):
    spawn(_listening, (str(tmp_path),), 2, tmp_path / "marks")
    assert [float((tmp_path / f"sum.{r}").read_text()) for r in range(2)] == [3.0, 3.0]
    # each rank counted the two collectives it entered: the count a stuck rank is told from the others by
    assert [(tmp_path / f"marks.{r}").read_text() for r in range(2)] == ["2 [0, 1]"] * 2


def test_a_join_waiting_for_a_lost_rank_gives_up_when_told():
    """A rank that died before it came would hold the others at the rendezvous for its whole timeout: told to
    abandon (by the driver, from another thread), joining fails at once and leaves the process as it was."""
    store = listen(2)
    told = threading.Event()
    threading.Timer(0.3, told.set).start()
    start = time.monotonic()
    with pytest.raises(JoinAbandoned, match="gave up waiting for 1 of 2 ranks"):
        TrainGroup.join(0, 2, device="cpu", timeout_s=600, store=store, abandon=told.is_set)
    assert 0.3 <= time.monotonic() - start < 60  # (at once, against the 600 s timeout; a busy machine is slow)
    assert not torch.distributed.is_initialized()


def test_a_rank_zero_gone_after_listening_fails_the_join_at_once():
    """Rank 0 told its port and died: the others fail now, not after the 600 s a store client would retry."""
    store = listen(2)
    port = store.port
    del store  # its end closes, as when its process dies
    start = time.monotonic()
    with pytest.raises(RendezvousGone, match=f"listened at 127.0.0.1:{port} and is gone"):
        TrainGroup.join(1, 2, master_port=port, device="cpu", timeout_s=600, listening=True)
    assert time.monotonic() - start < 60  # (at once, against the 600 s a client retries; a busy machine is slow)
    assert not torch.distributed.is_initialized()


def _after_a_failed_join(rank: int, out_dir: str) -> None:
    """Rank 1 first fails a join midway (its rank 0 never comes); then both meet in a new group."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    if rank == 1:
        lonely = listen(2, timeout_s=1)  # its own store: the group's keys are written, rank 0's never come
        lonely.add(ARRIVED, 1)  # (rank 0 counted in at the arrival, then lost before it made the group)
        with pytest.raises(Exception, match="(?i)timeout|timed out"):
            TrainGroup.join(1, 2, master_port=lonely.port, device="cpu", timeout_s=1)
        (out / "failed").write_text("1")
    deadline = time.monotonic() + TIMEOUT_S
    if rank == 0:
        while not (out / "failed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        store = listen(2, timeout_s=TIMEOUT_S)
        (out / "port.tmp").write_text(str(store.port))
        (out / "port.tmp").rename(out / "port")
        group = TrainGroup.join(0, 2, device="cpu", timeout_s=TIMEOUT_S, store=store)
    else:
        while not (out / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        group = TrainGroup.join(1, 2, master_port=int((out / "port").read_text()), device="cpu", timeout_s=TIMEOUT_S)
    with group:
        total = group.all_reduce_(torch.tensor([rank + 1.0]))
    (out / f"sum.{rank}").write_text(str(total.item()))


def test_a_rank_whose_join_failed_midway_meets_its_next_group(tmp_path):
    """torch names a process group by a per-process count that a failed join leaves one ahead: without
    starting over, the two ranks would write their keys under different names and wait forever."""
    spawn(_after_a_failed_join, (str(tmp_path),), 2, tmp_path / "marks")
    assert [float((tmp_path / f"sum.{r}").read_text()) for r in range(2)] == [3.0, 3.0]


def test_listen_and_its_store_are_checked():
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        listen(1)
    store = listen(2)
    with pytest.raises(ValueError, match="only rank 0 brings the end it listens on"):
        TrainGroup.join(1, 2, device="cpu", store=store)


def test_a_cuda_device_without_an_index_names_the_current_gpu(monkeypatch):
    """torch.cuda.set_device and NCCL's device_id refuse a bare ``cuda``, which is what a device is told."""
    from pivotrl.train.group import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")
