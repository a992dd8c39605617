"""What the GPS will hold and the object store sized from it: the arithmetic case by case, the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.gps import LocalStore, module_tensors
from pivotrl.gps_sizing import (
    FLOOR,
    GB,
    HEADROOM,
    check_nodes,
    for_job,
    holdings,
    joined_store,
    local_size,
    local_store,
)
from pivotrl.model import Decoder
from pivotrl.model.loader import read_config
from pivotrl.train.traits import TrainerKind

ROOT = Path(__file__).resolve().parents[1]
B7 = 7 * 10**9  # a 7B policy and judge
BASE = {"policy_dtype": "float32", "rollout_dtype": "bfloat16", "judge_dtype": "bfloat16", "keep_versions": 2,
        "reference": False, "checkpoints": True}  # fmt: skip


@pytest.mark.parametrize(
    ("params", "trainer", "changes", "expected"),
    [
        pytest.param(
            (B7, B7), TrainerKind.FSDP, {},
            {"judge": 2 * B7, "policy v0": 4 * B7, "2 policy versions": 4 * B7, "train state shards": 16 * B7,
             "checkpoint copy": 12 * B7},
            id="7b-fsdp-bf16-judge-fp32-v0",
        ),
        pytest.param(
            (B7, B7), TrainerKind.ZERO, {"checkpoints": False},
            {"judge": 2 * B7, "policy v0": 4 * B7, "2 policy versions": 4 * B7, "train state shards": 12 * B7},
            id="zero-shards-without-checkpoints",
        ),
        pytest.param(
            (B7, B7), TrainerKind.FSDP, {"judge_dtype": "float32"},
            {"judge": 4 * B7, "policy v0": 4 * B7, "2 policy versions": 4 * B7, "train state shards": 16 * B7,
             "checkpoint copy": 12 * B7},
            id="an-fp32-judge-doubles-its-share",
        ),
        pytest.param(
            (100, 50), TrainerKind.REPLICATED, {"rollout_dtype": "float32"},
            {"judge": 100, "policy v0": 400, "2 policy versions": 800, "optimizer state": 1600},
            id="replicated-on-cpus",
        ),
        pytest.param(
            (100, 50), TrainerKind.REPLICATED, {},
            {"judge": 100, "policy v0": 400, "2 policy versions": 800, "optimizer state": 1600},
            id="replicated-publishes-its-fp32-replica-whatever-the-rollout-dtype",
        ),
        pytest.param(
            (100, 0), TrainerKind.ZERO, {"reference": True, "keep_versions": 3, "policy_dtype": "bfloat16"},
            {"reference": 200, "policy v0": 200, "3 policy versions": 600, "train state shards": 1200,
             "checkpoint copy": 1200},
            id="kl-reference-and-three-versions",
        ),
        pytest.param(
            (100, 100), TrainerKind.ZERO, {"judge_dtype": "auto", "checkpoints": False},
            {"judge": 400, "policy v0": 400, "2 policy versions": 400, "train state shards": 1200},
            id="a-dtype-not-named-counts-the-widest",
        ),
    ],
)  # fmt: skip
def test_holdings(params: tuple[int, int], trainer: TrainerKind, changes: dict, expected: dict[str, int]) -> None:
    held = holdings(*params, trainer=trainer, **(BASE | changes))
    assert {k: v for k, v in held.pieces.items() if v} == expected
    assert held.total == sum(expected.values())
    assert held.need == math.ceil(held.total * HEADROOM)


def test_holdings_at_7b_exceed_a_30_percent_store_of_a_1_tb_node() -> None:
    held = holdings(B7, B7, trainer=TrainerKind.FSDP, **BASE)
    assert held.total == 266 * 10**9 and held.need > 0.3 * 1e12
    assert held.line().startswith("the GPS holds up to 266 GB (judge 14, policy v0 28, 2 policy versions 28,")


def test_keep_versions_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="keep_versions: got 0"):
        holdings(1, 1, trainer=TrainerKind.ZERO, **(BASE | {"keep_versions": 0}))


def test_the_policy_pieces_are_what_a_publish_stores(tiny_checkpoints: dict[str, Path]) -> None:
    """The parameter count read from config.json is what ``publish_checkpoint`` packs, to the alignment."""
    cfg = read_config(tiny_checkpoints["policy"])
    store = LocalStore()
    store.publish("policy", 0, module_tensors(Decoder(cfg)))
    packed = store.memory()["policy"]
    assert cfg.num_parameters() * 4 <= packed <= cfg.num_parameters() * 4 + 64 * len(module_tensors(Decoder(cfg)))


def test_for_job_reads_the_checkpoints_and_the_job(tiny_checkpoints: dict[str, Path]) -> None:
    paths = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"]
    cfg = load_config(ROOT / "examples/default.yaml", paths)
    p, j = (read_config(tiny_checkpoints[m]).num_parameters() for m in ("policy", "judge"))
    cpu = for_job(cfg, "cpu", 2)
    assert cpu.pieces == {"judge": 4 * j, "reference": 0, "policy v0": 4 * p, "2 policy versions": 8 * p,
                          "optimizer state": 16 * p}  # fmt: skip
    gpu = for_job(cfg, "cuda", 2)  # FSDP2, bf16 rollout; checkpoints every 10 steps by default
    assert gpu.pieces["2 policy versions"] == 4 * p and gpu.pieces["train state shards"] == 16 * p
    assert gpu.pieces["checkpoint copy"] == 12 * p
    shared = for_job(load_config(ROOT / "examples/default.yaml", [*paths, "gpus_per_device=0.5"]), "cuda", 2)
    assert shared.pieces["train state shards"] == 12 * p  # ZeRO-1 where devices share a GPU


def test_a_checkpoint_that_cannot_be_read_counts_nothing_here() -> None:
    cfg = load_config(ROOT / "examples/default.yaml", ["policy.path=/nonexistent", "judge.path=/nonexistent"])
    assert for_job(cfg, "cpu", 2).total == 0  # (publishing it stops the job later, with the loader's error)


@pytest.mark.parametrize(
    ("need", "memory", "shm", "expected"),
    [
        pytest.param(10**6, 64 * GB, 32 * GB, FLOOR, id="a-tiny-job-gets-the-floor"),
        pytest.param(5 * GB, 64 * GB, 32 * GB, 5 * GB, id="a-larger-job-gets-its-need"),
        pytest.param(10**6, 64 * GB, 300 * 2**20, 300 * 2**20, id="the-floor-only-where-there-is-room"),
        pytest.param(40 * GB, 64 * GB, 40 * GB, 40 * GB, id="exactly-what-is-free"),
    ],
)
def test_local_size(need: int, memory: int, shm: int, expected: int) -> None:
    assert local_size(need, memory, shm) == expected


@pytest.mark.parametrize(
    ("memory", "shm"),
    [pytest.param(20 * GB, 64 * GB, id="memory"), pytest.param(64 * GB, 20 * GB, id="shm")],
)
def test_a_machine_that_cannot_hold_the_need_is_one_line(memory: int, shm: int) -> None:
    with pytest.raises(UserError) as e:
        local_size(30 * GB, memory, shm)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("the GPS of this job needs an object store of 30 GB; this machine has ")
    assert f"{memory / GB:.3g} GB of memory free and {shm / GB:.3g} GB free in /dev/shm" in message


def test_a_local_store_is_preallocated_and_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    held = holdings(1000, 1000, trainer=TrainerKind.REPLICATED, **BASE)
    with caplog.at_level("INFO", logger="pivotrl"):
        store, kwargs = local_store(held)
    assert kwargs == {"object_store_memory": FLOOR, "_system_config": {"preallocate_plasma_memory": True}}
    assert store.to_dict() == {"bytes": FLOOR, "preallocated": True, "gps_bytes": held.total, "need": held.need}
    lines = [r.getMessage() for r in caplog.records if "the GPS holds up to" in r.getMessage()]
    assert lines == [
        "the GPS holds up to 0.03 MB (judge 0.002, policy v0 0.004, 2 policy versions 0.008, optimizer state 0.016); "
        "its object store needs 0.0375 MB; a local object store of 537 MB, preallocated"
    ]


@pytest.mark.parametrize(
    ("stores", "expected"),
    [
        pytest.param({"10.0.0.1": 8e9, "10.0.0.2": 6e9}, 6 * 10**9, id="the-smallest-node-counts"),
        pytest.param({}, 0, id="no-device-nodes"),
    ],
)
def test_check_nodes(stores: dict[str, float], expected: int) -> None:
    assert check_nodes(5 * 10**9, stores, "the Ray cluster at 10.0.0.1:6379") == expected


def test_a_cluster_node_that_cannot_hold_the_need_is_named_in_one_line() -> None:
    with pytest.raises(UserError) as e:
        check_nodes(5 * 10**9, {"10.0.0.1": 8e9, "10.0.0.2": 4e9}, "the Ray cluster at 10.0.0.1:6379")
    assert str(e.value).startswith(
        "the GPS of this job needs an object store of 5 GB on each node that runs devices; node 10.0.0.2 of the "
        "Ray cluster at 10.0.0.1:6379 has 4 GB (start its nodes with `ray start --object-store-memory=5000000000`"
    )


def test_a_joined_instance_is_read_at_the_nodes_its_devices_run_on(ray_cluster: None) -> None:
    """The session's Ray (512 MiB of object store) as a cluster the job joins: its devices' node is read, and a
    need beyond its store is refused in one line naming it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}])
    try:
        assert pg.wait(timeout_seconds=60)
        fits = joined_store(holdings(10**6, 10**6, trainer=TrainerKind.REPLICATED, **BASE), pg, 1, "this machine")
        assert fits.bytes == 512 * 2**20 and fits.preallocated is None
        with pytest.raises(UserError, match=r"needs an object store of 3\.5 GB on each node that runs devices; node "):
            joined_store(holdings(10**8, 0, trainer=TrainerKind.REPLICATED, **BASE), pg, 1, "this machine")
    finally:
        remove_placement_group(pg)
