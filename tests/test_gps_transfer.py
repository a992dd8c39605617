"""The staging buffer a process keeps for host-device copies, and loads through it: bookkeeping tested on a CPU
(the allocator is injected; a CPU build has no page-locking)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pivotrl.gps import ALIGN, PAGE, LocalStore, module_tensors, publish_model
from pivotrl.gps_transfer import Staging, load_bucketed
from pivotrl.model import Decoder
from tests.conftest import tiny_config


class FakeAllocator:
    """Stands in for page-aligned allocation plus cudaHostRegister/Unregister: records what it is asked."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self.calls: list[tuple[str, int]] = []

    def allocate(self, nbytes: int) -> tuple[np.ndarray, bool]:
        assert nbytes % PAGE == 0
        self.calls.append(("allocate", nbytes))
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        return raw[start : start + nbytes], self.pin

    def release(self, buffer: np.ndarray, pinned: bool) -> None:
        assert pinned == self.pin
        self.calls.append(("release", buffer.nbytes))


def staging(pin: bool = True) -> tuple[Staging, FakeAllocator]:
    fake = FakeAllocator(pin)
    return Staging(fake.allocate, fake.release), fake


def test_staging_grows_for_a_larger_request_and_is_reused_otherwise() -> None:
    s, fake = staging()
    with s.hold(100) as a:
        assert a.nbytes == 100 and a.flags.writeable and a.ctypes.data % PAGE == 0
        first = a.ctypes.data
    with s.hold(PAGE) as b:  # fits: the same pages, nothing allocated or locked again
        assert b.ctypes.data == first
    assert fake.calls == [("allocate", PAGE)] and s.capacity == PAGE and s.pinned
    with s.hold(3 * PAGE + 1) as c:  # larger: the old buffer goes first, then one of whole pages
        assert c.nbytes == 3 * PAGE + 1
    assert fake.calls == [("allocate", PAGE), ("release", PAGE), ("allocate", 4 * PAGE)]
    with s.hold(10):  # never shrinks
        pass
    assert s.allocations == 2 and s.capacity == 4 * PAGE
    s.release()
    assert fake.calls[-1] == ("release", 4 * PAGE) and s.capacity == 0


def test_staging_that_cannot_be_page_locked_still_serves_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    s, fake = staging(pin=False)
    with caplog.at_level("WARNING", logger="pivotrl"):
        for n in (10, 2 * PAGE, 5 * PAGE):
            with s.hold(n) as view:
                view[:] = 7
    assert not s.pinned and s.allocations == 3
    assert len([r for r in caplog.records if "cannot page-lock" in r.getMessage()]) == 1


def test_a_process_without_a_gpu_asks_for_no_page_locking_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def allocate(nbytes: int) -> tuple[np.ndarray, None]:
        return np.empty(nbytes, dtype=np.uint8), None

    s = Staging(allocate, lambda buffer, pinned: None)
    with caplog.at_level("WARNING", logger="pivotrl"), s.hold(3 * PAGE):
        pass
    assert not s.pinned and not caplog.records


def test_the_default_allocator_touches_no_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda() -> None:
        raise AssertionError("the CUDA runtime was called in a process without CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    s = Staging()
    with s.hold(PAGE + 1) as view:
        view[:] = 1
    assert s.capacity == 2 * PAGE and not s.pinned
    s.release()


def test_a_held_staging_buffer_is_one_callers_at_a_time() -> None:
    import threading

    s, _ = staging()
    order: list[str] = []
    with s.hold(10):
        t = threading.Thread(target=lambda: (s.hold(10).__enter__(), order.append("second")))
        t.start()
        t.join(0.2)
        order.append("first done")
    t.join(120)  # (returns as soon as the second holder is through)
    assert order == ["first done", "second"]


def model(seed: int, dtype: torch.dtype = torch.float32, tied: bool = False) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(tiny_config(tied=tied)).to(dtype)


@pytest.mark.parametrize("bucket", [64, 1000, 2**20])
@pytest.mark.parametrize(
    ("stored", "target"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_a_load_through_the_staging_buffer_equals_a_plain_load(
    bucket: int, stored: torch.dtype, target: torch.dtype
) -> None:
    """The path a GPU takes, run on the CPU: buckets cycled through two slots of the staging buffer."""
    source = model(0, stored, tied=True)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    store = LocalStore()
    publish_model(store, "m", 0, source)
    snap = store.fetch("m", 0)
    plain, staged = model(1, target, tied=True), model(2, target, tied=True)
    snap.load_into(plain, bucketed=False)
    s, fake = staging()
    targets = {n: t for n, t in staged.state_dict(keep_vars=True).items() if n in snap.tensors}
    load_bucketed(snap, targets, bucket, staging=s)
    for name, t in module_tensors(plain).items():
        assert torch.equal(module_tensors(staged)[name], t), name
    slot = -(-max(bucket // ALIGN * ALIGN, ALIGN) // PAGE) * PAGE
    assert s.capacity <= 2 * slot  # two buckets' worth, whatever the model's size
    assert s.capacity < snap.nbytes or bucket >= snap.nbytes // 2


def test_loads_reuse_one_staging_buffer_and_grow_it_for_larger_buckets() -> None:
    store = LocalStore()
    publish_model(store, "m", 0, model(0))
    snap = store.fetch("m", 0)
    s, fake = staging()
    for bucket in (1024, 1024, 512):
        target = model(1)
        load_bucketed(snap, dict(target.state_dict(keep_vars=True)), bucket, staging=s)
        assert torch.equal(target.model.norm.weight, snap.tensors["model.norm.weight"])
    assert s.allocations == 1  # the same two slots for every load
    load_bucketed(snap, dict(model(1).state_dict(keep_vars=True)), 64 * PAGE, staging=s)
    assert s.allocations == 2 and [c for c, _ in fake.calls] == ["allocate", "release", "allocate"]
