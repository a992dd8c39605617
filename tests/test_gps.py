"""Global Parameter Storage: one contract, run against LocalStore and RayStore, plus Ray ownership.

Ray starts once per session (``ray_cluster``, written so it can move to
tests/conftest.py unchanged) and one directory actor serves every Ray test;
tests stay apart by using their own model names, since starting an actor per
test would cost a worker process each.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from pivotrl.gps import (
    ALIGN,
    PAGE,
    TOTAL,
    Deferred,
    Kind,
    LoadError,
    LocalStore,
    ParameterStore,
    RayStore,
    TensorEntry,
    VersionError,
    cast,
    module_tensors,
    pack,
    publish_model,
    publish_optimizer,
    restore_optimizer,
    unpack,
)
from pivotrl.gps_transfer import HostPins, page_interior, plan_buckets
from pivotrl.model import Decoder, ModelConfig
from tests.conftest import tiny_config

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def tiny(seed: int, tied: bool = False) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(tiny_config(tied=tied))


TOKENS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ray_store(ray_cluster: None) -> Iterator[RayStore]:
    store = RayStore.create(f"gps-test-{uuid.uuid4().hex[:8]}")
    yield store
    store.shutdown()


@pytest.fixture(params=["local", "ray"])
def store(request: pytest.FixtureRequest) -> ParameterStore:
    if request.param == "local":
        return LocalStore()
    request.getfixturevalue("ray_roles")  # start their workers now: start-up overlaps the contract tests
    return request.getfixturevalue("ray_store")


@pytest.fixture
def name() -> str:
    """A model name no other test uses, so tests sharing the Ray directory stay apart."""
    return f"m-{uuid.uuid4().hex[:8]}"


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------------------------------
# Layout


def test_pack_unpack_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "fp32": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, generator=g).to(torch.float16),
        "int64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # non-contiguous source
    }
    buffer, entries = pack(tensors)
    assert all(e.offset % ALIGN == 0 for e in entries)
    assert buffer.ctypes.data % ALIGN == 0 and not buffer.flags.writeable
    assert_same(unpack(buffer, entries), tensors)


def test_deferred_tensors_are_made_one_at_a_time_as_their_turn_comes() -> None:
    """A publisher that gathers (or casts) each tensor only when it is copied: the buffer is laid out from the
    declared dtypes and shapes, each tensor is made once, in order, after the one before was copied, and
    copied as the declared dtype; the bytes equal those of the tensors packed whole."""
    g = torch.Generator().manual_seed(2)
    source = {
        "a": torch.randn(4, 3, generator=g),
        "b": torch.randn(5, generator=g),
        "c": torch.randn(2, 2, generator=g),
    }
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return source[name]  # fp32, copied as bf16

    deferred = {n: Deferred(torch.bfloat16, tuple(t.shape), lambda n=n: make(n)) for n, t in source.items()}
    buffer, entries = pack(deferred)
    assert made == ["a", "b", "c"]
    whole, whole_entries = pack({n: t.to(torch.bfloat16) for n, t in source.items()})
    assert entries == whole_entries and bytes(buffer) == bytes(whole)


def test_a_deferred_tensor_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="'w': made a tensor of shape \\(3,\\), declared \\(4,\\)"):
        pack({"w": Deferred(torch.float32, (4,), lambda: torch.zeros(3))})


def test_cast_copies_nothing_where_the_dtype_is_already_right() -> None:
    t = torch.randn(3)
    assert cast(t, torch.float32) is t
    lazy = cast(t, torch.bfloat16)
    assert isinstance(lazy, Deferred) and lazy.dtype == torch.bfloat16 and lazy.shape == (3,)
    buffer, entries = pack({"t": lazy})
    assert torch.equal(unpack(buffer, entries)["t"], t.to(torch.bfloat16))


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(TypeError, match="complex64"):
        pack({"z": torch.zeros(2, dtype=torch.complex64)})


# ---------------------------------------------------------------------------------------------------------------------
# Contract: both backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_publish_fetch_round_trip(store: ParameterStore, name: str, dtype: torch.dtype) -> None:
    assert isinstance(store, ParameterStore)
    model = tiny(0).to(dtype)
    info = publish_model(store, name, 0, model)
    snap = store.fetch(name, 0)
    assert info.nbytes == snap.nbytes and info.seconds > 0
    assert (snap.manifest.model_name, snap.version, snap.manifest.kind) == (name, 0, Kind.WEIGHTS)
    assert_same(snap.state_dict(), module_tensors(model))


def test_a_publish_of_host_tensors_copies_them_once_and_the_object_store_once(store: ParameterStore, name: str) -> None:
    info = publish_model(store, name, 0, tiny(0))
    assert info.host_copies == (1.0 if isinstance(store, LocalStore) else 2.0)  # the pack; Ray's put into its store


def test_fetch_is_zero_copy(store: ParameterStore, name: str) -> None:
    publish_model(store, name, 0, tiny(0))
    snap = store.fetch(name, 0)
    base = snap.buffer.ctypes.data
    for entry in snap.manifest.entries:
        view = snap.tensors[entry.name]
        assert view.data_ptr() == base + entry.offset  # a view into the buffer, not a copy
        assert base <= view.untyped_storage().data_ptr() < base + snap.buffer.nbytes
    if isinstance(store, LocalStore):
        assert store.fetch(name, 0).buffer.ctypes.data == base  # the stored buffer itself, every time
    else:
        # mapped from the shared-memory object store, owned by Ray, read-only
        assert snap.buffer.flags.owndata is False and snap.buffer.flags.writeable is False


def test_versioning_and_memory(store: ParameterStore, name: str) -> None:
    model = tiny(0)
    assert store.latest(name) is None and store.versions(name) == []
    sizes = [publish_model(store, name, v, model).nbytes for v in range(4)]
    assert store.latest(name) == 3 and store.versions(name) == [0, 1, 2, 3]
    before = store.memory()
    assert before[name] == sum(sizes) and before[TOTAL] >= sum(sizes)

    assert store.retain(name, keep_last=2) == [0, 1]
    assert store.versions(name) == [2, 3]
    after = store.memory()
    assert after[name] == sizes[2] + sizes[3]
    assert before[TOTAL] - after[TOTAL] == sizes[0] + sizes[1]
    with pytest.raises(VersionError):
        store.fetch(name, 0)

    with pytest.raises(VersionError, match="immutable"):
        publish_model(store, name, 3, tiny(1))
    assert_same(store.fetch(name, 3).state_dict(), module_tensors(model))  # the original survived

    with pytest.raises(VersionError):
        store.free(name, 7)
    store.free(name, 2)
    assert store.versions(name) == [3]
    # weights and optimizer state of a version are separate entries
    assert store.versions(name, Kind.OPTIMIZER) == []


def test_version_error_names_model_version_and_what_exists(store: ParameterStore, name: str) -> None:
    for v in (1, 2):
        publish_model(store, name, v, tiny(0))
    with pytest.raises(VersionError) as err:
        store.fetch(name, 5)
    message = str(err.value)
    assert name in message and "version 5" in message and "[1, 2]" in message
    with pytest.raises(VersionError, match="none published"):
        store.fetch(name + "-other", 0)


def test_bad_arguments_are_named(store: ParameterStore, name: str) -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        store.fetch(name, 0, kind="gradients")
    with pytest.raises(ValueError, match="version must be"):
        store.publish(name, -1, {})
    with pytest.raises(ValueError, match="model_name"):
        store.publish(TOTAL, 0, {})
    with pytest.raises(ValueError, match="keep_last"):
        store.retain(name, keep_last=-1)


@pytest.mark.parametrize("tied", [False, True])
def test_load_into_reproduces_the_source(store: ParameterStore, name: str, tied: bool) -> None:
    source, target = tiny(0, tied), tiny(1, tied)
    publish_model(store, name, 0, source)
    store.fetch(name, 0).load_into(target)
    with torch.no_grad():
        assert torch.equal(target(TOKENS), source(TOKENS))
    if tied:
        assert target.lm_head.weight is target.model.embed_tokens.weight


def test_load_into_is_strict() -> None:
    store = LocalStore()
    tensors = module_tensors(tiny(0))
    tensors.pop("model.norm.weight")
    tensors["extra"] = torch.zeros(1)
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    store.publish("m", 0, tensors)
    with pytest.raises(LoadError) as err:
        store.fetch("m", 0).load_into(tiny(1))
    message = str(err.value)
    assert "model.norm.weight" in message and "extra" in message and "lm_head.weight: stored (3, 3)" in message


def test_optimizer_state_offload_and_restore(store: ParameterStore, name: str) -> None:
    def train_step(model: Decoder, optimizer: torch.optim.Optimizer, seed: int) -> None:
        # seeded gradients instead of a backward pass: the same update on both sides, at a fraction of the cost
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()

    model = tiny(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for seed in range(3):
        train_step(model, optimizer, seed)
    publish_model(store, name, 3, model)
    publish_optimizer(store, name, 3, optimizer, model)
    stored = store.fetch(name, 3, Kind.OPTIMIZER).state_dict(copy=True)
    assert any(k.endswith(".exp_avg_sq") for k in stored)

    # another "device": a fresh model and optimizer rebuilt only from the store
    copy = tiny(1)
    store.fetch(name, 3).load_into(copy)
    restored = torch.optim.AdamW(copy.parameters(), lr=1e-2, weight_decay=0.1)
    restore_optimizer(store, name, 3, restored, copy)
    train_step(model, optimizer, 3)
    train_step(copy, restored, 3)
    for (n, a), (_, b) in zip(model.named_parameters(), copy.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    # the restored optimizer owns its state: stepping it left the published version untouched
    assert_same(store.fetch(name, 3, Kind.OPTIMIZER).state_dict(), stored)


def test_optimizer_restore_rejects_another_model() -> None:
    store = LocalStore()
    model = tiny(0)
    optimizer = torch.optim.AdamW(model.parameters())
    publish_optimizer(store, "m", 0, optimizer, model)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(LoadError, match="param group 0"):
        restore_optimizer(store, "m", 0, torch.optim.AdamW(other.parameters()), other)
    with pytest.raises(LoadError, match="'AdamW', not SGD"):
        restore_optimizer(store, "m", 0, torch.optim.SGD(model.parameters(), lr=0.1), model)


# ---------------------------------------------------------------------------------------------------------------------
# Ray: versions cross processes and outlive their publisher


@pytest.fixture(scope="module")
def ray_roles(ray_cluster: None) -> Iterator[tuple[ActorHandle, ActorHandle]]:
    """A publisher and a reader actor, each in its own worker process.

    The classes are defined in here so that Ray pickles them by value: workers cannot import tests/.
    """
    import ray

    @ray.remote(num_cpus=0)
    class Publisher:
        def __init__(self) -> None:
            import pivotrl.gps  # noqa: F401  (torch and all: imported while other tests run)

        def publish(self, store: RayStore, model_name: str, version: int, cfg: ModelConfig, seed: int) -> int:
            import os

            import torch

            from pivotrl.gps import publish_model
            from pivotrl.model import Decoder

            torch.manual_seed(seed)
            publish_model(store, model_name, version, Decoder(cfg))
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self) -> None:
            import pivotrl.gps  # noqa: F401

        def read(self, store: RayStore, model_name: str, version: int) -> dict[str, torch.Tensor]:
            return store.fetch(model_name, version).state_dict(copy=True)

    publisher, reader = Publisher.remote(), Reader.remote()
    yield publisher, reader
    ray.kill(publisher)
    ray.kill(reader)


def test_ray_directory_is_found_by_name(ray_store: RayStore, name: str) -> None:
    publish_model(ray_store, name, 0, tiny(0))
    assert RayStore.connect(ray_store.name).versions(name) == [0]
    with pytest.raises(ValueError, match="no GPS directory named 'absent'"):
        RayStore.connect("absent")
    with pytest.raises(ValueError, match=f"cannot create GPS directory {ray_store.name!r}"):
        RayStore.create(ray_store.name)


def test_ray_version_outlives_its_publisher(
    ray_store: RayStore, ray_roles: tuple[ActorHandle, ActorHandle], name: str
) -> None:
    import ray

    publisher, reader = ray_roles
    pid = ray.get(publisher.publish.remote(ray_store, name, 0, tiny_config(), 5))
    expected = module_tensors(tiny(5))
    assert_same(ray.get(reader.read.remote(ray_store, name, 0)), expected)
    assert_same(ray_store.fetch(name, 0).state_dict(), expected)

    ray.kill(publisher)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"publisher process {pid} still alive 10 s after ray.kill")
    time.sleep(0.5)  # a borrowed object would now be reported lost (OwnerDiedError)
    assert_same(ray_store.fetch(name, 0).state_dict(), expected)
    assert_same(ray.get(reader.read.remote(ray_store, name, 0)), expected)
    assert np.array_equal(ray_store.fetch(name, 0).buffer, pack(expected)[0])  # byte for byte, padding included


def test_a_gpu_process_publishes_through_one_kept_staging_buffer(
    ray_store: RayStore, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``publish_staging`` gives a process that computes on a GPU, with the page-locking faked: every
    publish packs into the same buffer, and the object store holds each version's own bytes."""
    import pivotrl.gps_transfer as transfer

    calls: list[int] = []

    def allocate(nbytes: int) -> tuple[np.ndarray, bool]:
        calls.append(nbytes)
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        return raw[start : start + nbytes], True

    staging = transfer.Staging(allocate, lambda buffer, pinned: None)
    monkeypatch.setattr(transfer, "publish_staging", lambda: staging)
    models = [tiny(seed) for seed in range(3)]
    infos = [publish_model(ray_store, name, v, m) for v, m in enumerate(models)]
    assert len(calls) == 1  # one buffer for every publish of the process
    for v, m in enumerate(models):
        assert np.array_equal(ray_store.fetch(name, v).buffer, pack(module_tensors(m))[0])
    assert [i.host_copies for i in infos] == [2.0] * 3  # (host tensors: packed by the CPU, then Ray's put)


def test_the_directory_adopts_a_version_once(ray_store: RayStore, name: str) -> None:
    """What a fetch asks when a version's publisher is gone: the directory puts the bytes it holds again and
    owns them; asked again, it has nothing more to do."""
    import ray

    model = tiny(3)
    publish_model(ray_store, name, 0, model)
    key = (name, 0, Kind.WEIGHTS)
    for _ in range(2):
        manifest, refs, error = ray.get(ray_store.directory.adopt.remote(key))
        assert error is None and manifest.version == 0
        assert np.array_equal(ray.get(refs[0]), pack(module_tensors(model))[0])
    assert_same(ray_store.fetch(name, 0).state_dict(), module_tensors(model))
    ray_store.free(name, 0)
    assert "none published" in ray.get(ray_store.directory.adopt.remote(key))[2]


# ---------------------------------------------------------------------------------------------------------------------
# Loading at memory speed: buckets, casts on the device, page-locked buffers (bookkeeping tested without a GPU)


def entries_of(sizes: list[int]) -> list[TensorEntry]:
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    from pivotrl.gps import layout

    return list(layout(tensors)[0])


@pytest.mark.parametrize(
    ("sizes", "bucket", "expected_buckets"),
    [
        pytest.param([10, 20, 30], 1024, 1, id="small-tensors-share-one-bucket"),
        pytest.param([1000, 1000, 1000], 1024, 3, id="one-per-bucket-when-two-do-not-fit"),
        pytest.param([5000], 1024, 5, id="large-tensor-cut-in-pieces"),
        pytest.param([100, 5000, 100], 1024, 7, id="cut-tensor-between-small-ones"),
        pytest.param([0, 64, 0], 100, 1, id="empty-tensors-carry-nothing"),
        pytest.param([3], 10, 1, id="bucket-rounded-up-to-align"),
    ],
)
def test_plan_buckets_cover_every_byte_once(sizes: list[int], bucket: int, expected_buckets: int) -> None:
    entries = entries_of(sizes)
    buckets = plan_buckets(entries, bucket)
    assert len(buckets) == expected_buckets
    limit = max(ALIGN, bucket // ALIGN * ALIGN)
    covered: dict[str, list[tuple[int, int]]] = {}
    for b in buckets:
        assert b.end - b.start <= limit and b.start == b.pieces[0].start and b.end == b.pieces[-1].end
        for p in b.pieces:
            assert (p.start - b.start) % ALIGN == 0  # each piece viewable as its dtype inside the staging buffer
            assert p.entry.offset <= p.start < p.end <= p.entry.offset + p.entry.nbytes
            covered.setdefault(p.entry.name, []).append((p.start, p.end))
    for e in entries:
        spans = covered.get(e.name, [])
        assert sum(b - a for a, b in spans) == e.nbytes, e.name
        assert all(a2 == b1 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))


class Strided(torch.nn.Module):
    """A parameter whose storage is not in row-major order: it cannot take a slice of flat bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(6, 5).t())
        self.b = torch.nn.Parameter(torch.empty(7))


@pytest.mark.parametrize("bucket", [64, 1000, 2**20])
@pytest.mark.parametrize(
    ("stored", "target", "tied"),
    [
        (torch.float32, torch.bfloat16, False),  # fp32 master weights into a bf16 rollout copy
        (torch.float32, torch.bfloat16, True),
        (torch.bfloat16, torch.float32, False),
        (torch.float32, torch.float32, True),  # same dtype: bytes straight into the parameters
    ],
)
def test_bucketed_load_equals_plain_load(bucket: int, stored: torch.dtype, target: torch.dtype, tied: bool) -> None:
    """The path a GPU takes, run on the CPU: byte buckets, then per-tensor casts, give what ``copy_`` gives."""
    source = tiny(0, tied).to(stored)
    with torch.no_grad():
        for p in source.parameters():  # values bf16 cannot hold exactly: the cast must happen, and only once
            p.add_(torch.randn_like(p) * 1e-3)
    store = LocalStore()
    publish_model(store, "m", 0, source)
    snap = store.fetch("m", 0)
    plain, bucketed = tiny(1, tied).to(target), tiny(2, tied).to(target)
    snap.load_into(plain, bucketed=False)
    snap.load_into(bucketed, bucketed=True, bucket_bytes=bucket)
    assert_same(module_tensors(bucketed), module_tensors(plain))
    if tied:
        assert bucketed.lm_head.weight is bucketed.model.embed_tokens.weight
    if (stored, target) == (torch.float32, torch.bfloat16):  # a real, rounding conversion took place
        assert not torch.equal(plain.model.norm.weight.to(stored), source.model.norm.weight)


def test_bucketed_load_of_mixed_dtypes() -> None:
    """A bucket holding tensors that need a cast beside tensors that do not (bf16 weights, fp32 norms)."""
    source = tiny(0).to(torch.bfloat16)
    source.model.norm.float()
    for layer in source.model.layers:
        layer.input_layernorm.float()
    store = LocalStore()
    publish_model(store, "m", 0, source)
    dtypes = {e.dtype for e in store.fetch("m", 0).manifest.entries}
    assert dtypes == {"bfloat16", "float32"}
    for target_dtype in (torch.bfloat16, torch.float32):
        plain, bucketed = tiny(1).to(target_dtype), tiny(2).to(target_dtype)
        store.fetch("m", 0).load_into(plain, bucketed=False)
        store.fetch("m", 0).load_into(bucketed, bucketed=True, bucket_bytes=4096)
        assert_same(module_tensors(bucketed), module_tensors(plain))


def test_bucketed_load_handles_strided_targets() -> None:
    source, plain, bucketed = Strided(), Strided(), Strided()
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn(p.shape))
    store = LocalStore()
    store.publish("s", 0, module_tensors(source))
    store.fetch("s", 0).load_into(plain, bucketed=False)
    store.fetch("s", 0).load_into(bucketed, bucketed=True, bucket_bytes=64)
    assert not bucketed.w.is_contiguous()
    assert torch.equal(bucketed.w, source.w) and torch.equal(bucketed.b, source.b)
    assert torch.equal(plain.w, source.w)


@pytest.mark.parametrize(
    ("address", "nbytes", "expected"),
    [
        (0, 3 * PAGE, (0, 3 * PAGE)),  # page-aligned, whole pages: all of it
        (0, 3 * PAGE + 10, (0, 3 * PAGE)),  # the last partial page is left out
        (10, 3 * PAGE, (PAGE - 10, 3 * PAGE - 10)),  # both partial pages left out
        (10, PAGE, (0, 0)),  # no whole page inside
        (PAGE - 1, PAGE + 1, (1, PAGE + 1)),
    ],
)
def test_page_interior(address: int, nbytes: int, expected: tuple[int, int]) -> None:
    assert page_interior(address, nbytes) == expected


class FakeCuda:
    """Stands in for cudaHostRegister/Unregister: records calls, refuses what it is told to."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, nbytes: int) -> bool:
        self.calls.append(("register", address))
        assert address % PAGE == 0 and nbytes % PAGE == 0
        assert all(address + nbytes <= a or a + n <= address for a, n in self.registered.items()), "pages twice"
        if self.accept:
            self.registered[address] = nbytes
        return self.accept

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        del self.registered[address]


def test_pins_register_once_per_buffer_and_let_go_with_the_last_user() -> None:
    import gc

    cuda = FakeCuda()
    pins = HostPins(cuda.register, cuda.unregister)
    raw = np.empty(6 * PAGE, dtype=np.uint8)
    first = raw[100 : 100 + 4 * PAGE]  # a version in shared memory, not page-aligned
    lo, hi = pins.pin(first)  # type: ignore[misc]
    assert (first.ctypes.data + lo) % PAGE == 0 and hi - lo == 3 * PAGE
    assert pins.pin(first) == (lo, hi)  # the same buffer again: nothing new
    second = first[:]  # another fetch of the same object: another array over the same memory
    assert pins.pin(second) == (lo, hi)
    assert [c for c, _ in cuda.calls] == ["register"] and pins.registered_bytes == 3 * PAGE
    del first
    gc.collect()
    assert [c for c, _ in cuda.calls] == ["register"]  # still in use by the second snapshot
    del second
    gc.collect()
    assert [c for c, _ in cuda.calls] == ["register", "unregister"] and not cuda.registered
    assert pins.registered_bytes == 0


def test_pins_that_cuda_refuses_fall_back_to_pageable_copies(caplog: pytest.LogCaptureFixture) -> None:
    cuda = FakeCuda(accept=False)
    pins = HostPins(cuda.register, cuda.unregister)
    buffers = [np.empty(3 * PAGE, dtype=np.uint8) for _ in range(2)]
    with caplog.at_level("WARNING", logger="pivotrl"):
        assert pins.pin(buffers[0]) is None and pins.pin(buffers[1]) is None
    assert len([r for r in caplog.records if "page-lock" in r.message]) == 1  # said once, not per load
    assert pins.pin(np.empty(10, dtype=np.uint8)) is None  # no whole page: nothing asked of CUDA
    assert len(cuda.calls) == 2


def test_without_cuda_nothing_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda() -> None:
        raise AssertionError("the CUDA runtime was called on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    store = LocalStore()
    publish_model(store, "m", 0, tiny(0))
    snap = store.fetch("m", 0)
    assert snap.pin() is False
    for bucketed in (None, True, False):
        target = tiny(1)
        snap.load_into(target, bucketed=bucketed)
        assert_same(module_tensors(target), snap.tensors)
