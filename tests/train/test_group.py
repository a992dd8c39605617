"""A train group's bounds on waiting for a lost member: a collective timeout well under the driver's, and an
NCCL communicator aborted when the driver says a member is lost (logic only: NCCL needs GPUs)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.train import group as group_module
from pivotrl.train.group import MIN_COLLECTIVE_S, NCCL_SETTINGS, TrainGroup, collective_timeout
from tests.conftest import planned


@pytest.mark.parametrize(
    ("device_timeout", "want"),
    [(600.0, 200.0), (3600.0, 1200.0), (120.0, MIN_COLLECTIVE_S), (30.0, MIN_COLLECTIVE_S)],
    ids=["default", "long", "short: the floor", "shorter than the floor"],
)
def test_a_collective_waits_well_under_the_drivers_bound(device_timeout, want):
    assert collective_timeout(device_timeout) == want


def joined(backend: str) -> TrainGroup:
    g = TrainGroup(0, 2, torch.device("cpu"), backend, "tcp://127.0.0.1:1")
    g._joined = True  # (as join leaves it; no process group is made here)
    return g


def test_an_nccl_group_is_aborted_once_and_left_although_its_teardown_fails(monkeypatch):
    aborted, destroyed = [], []
    monkeypatch.setattr(group_module.dist.distributed_c10d, "_abort_process_group", lambda: aborted.append(1))

    def destroy() -> None:
        destroyed.append(1)
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(group_module.dist, "destroy_process_group", destroy)
    g = joined("nccl")
    g.abort()
    g.abort()
    assert aborted == [1] and g.aborted
    g.leave()
    assert destroyed == [1] and not g.active


def test_a_gloo_group_is_not_aborted_and_a_failing_teardown_of_a_live_group_is_raised(monkeypatch):
    monkeypatch.setattr(group_module.dist.distributed_c10d, "_abort_process_group", lambda: pytest.fail("aborted"))
    monkeypatch.setattr(group_module.dist, "destroy_process_group", lambda: (_ for _ in ()).throw(RuntimeError("x")))
    g = joined("gloo")
    g.abort()  # (gloo fails by itself as a dead peer's connections close)
    assert not g.aborted
    with pytest.raises(RuntimeError):
        g.leave()


class _Group:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def test_the_driver_abandoning_a_step_in_progress_aborts_its_group_and_no_other():
    from pivotrl.gps import LocalStore
    from pivotrl.runtime.contexts import ContextSpec

    w = Worker(0, LocalStore(), ContextSpec(), TrainSpec(planned(), 1.0), origin=time.time())
    g = _Group()
    w._abandoned, w._in_step, w._attempt, w._step_group = -1, True, 4, g
    w.abandon(3)  # an earlier attempt's: not this step's group
    assert g.aborts == 0
    w.abandon(4)
    assert g.aborts == 1 and w._abandoned == 4
    w._in_step, w._step_group = False, None
    w.abandon(5)  # before its step starts: it will not meet its group (JoinAbandoned), nothing to abort
    assert w._abandoned == 5


def test_nccl_raises_in_the_rank_and_keeps_the_process_when_a_collective_fails(monkeypatch):
    """A rank's wait on an NCCL collective raises in its own thread on a timeout or an abort (blocking wait), and
    the watchdog keeps the process: set for NCCL groups where the user set nothing."""
    assert dict(NCCL_SETTINGS) == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    for key, _ in NCCL_SETTINGS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(group_module.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(group_module.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(group_module, "indexed", lambda d: torch.device("cuda", 0))
    TrainGroup.join(0, 1, device="cuda", process_group=True)
    assert all(os.environ[key] == value for key, value in NCCL_SETTINGS)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    TrainGroup.join(0, 1, device="cuda", process_group=True)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # (the user's own setting)


def test_nothing_computed_over_an_aborted_group_is_published(monkeypatch):
    monkeypatch.setattr(group_module.dist.distributed_c10d, "_abort_process_group", lambda: None)
    g = joined("nccl")
    g.check_intact()
    g.abort()
    with pytest.raises(RuntimeError, match="the step is void"):
        g.check_intact()


def test_a_rank_that_fails_out_of_a_collective_lets_go_of_its_process_group_as_it_leaves(monkeypatch):
    """What a failed collective's traceback holds (the process group, its pending work) is let go before the
    group is destroyed, or the connections would stay open and a member waiting on this rank (gloo's ring: two
    away from a lost one) would wait for its timeout."""
    import weakref

    class ProcessGroup:  # (stands for what torch's frames hold)
        pass

    def collective(pg: ProcessGroup) -> None:
        raise RuntimeError("Connection closed by peer")

    def run() -> RuntimeError:
        pg = ProcessGroup()
        held.append(weakref.ref(pg))
        try:
            collective(pg)
        except RuntimeError as e:
            return e
        raise AssertionError("no error")

    held: list[weakref.ref] = []
    error = run()
    assert held[0]() is not None  # (the traceback's frames hold it)
    destroyed: list[bool] = []
    monkeypatch.setattr(group_module.dist, "destroy_process_group", lambda: destroyed.append(held[0]() is None))
    joined("gloo").leave_after(error)
    assert destroyed == [True] and "Connection closed" in str(error)
