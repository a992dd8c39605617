"""End to end on Ray: 4 CPU devices, colocated and disaggregated, against one local device."""

import json
from pathlib import Path

import pytest

from pivotrl.model.config import ModelConfig
from pivotrl.runtime.job import run_job
from tests.runtime.test_job import small_job

KEYS = ("reward_mean", "accuracy", "response_length", "response_tokens", "judge_tokens", "parse_failures")


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_device(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_job(small_job(tiny_checkpoints, "steps=2", "eval.every=1"), out, progress=False)
    return metrics(out)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_four_ray_devices_match_one_local_device(mode, one_device, tiny_checkpoints, tmp_path, ray_cluster):
    cfg = small_job(tiny_checkpoints, "steps=2", "eval.every=1", f"mode={mode}", "devices=4", "rollout.max_batch=4")
    summary = run_job(cfg, tmp_path, progress=False)
    many = metrics(tmp_path)
    assert [m["step"] for m in many] == [1, 2]
    for a, b in zip(one_device, many, strict=True):
        for key in KEYS:  # same samples, same rewards: sampling depends on (seed, position) only
            assert a[key] == b[key], key
        assert a["heldout_accuracy"] == b["heldout_accuracy"]
        assert b["train_grad_norm"] == pytest.approx(a["train_grad_norm"], rel=1e-4)
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-3, abs=1e-6)
    assert summary["devices"] == 4 and summary["shifts"] >= 4
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {e["device"] for e in events} == {0, 1, 2, 3}
    if mode == "disaggregated":  # a static split: each device only ever does its own role's work
        roles = {d: {e["role"] for e in events if e["device"] == d and e["role"] not in ("shift", "migrate")}
                 for d in range(4)}  # fmt: skip
        assert roles == {0: {"rollout"}, 1: {"rollout"}, 2: {"judge"}, 3: {"train"}}
        # sequences may move between the two rollout devices (rebalancing, when their loads part), never elsewhere
        assert {e["device"] for e in events if e["role"] == "migrate"} <= {0, 1}
    json.loads((tmp_path / "trace.json").read_text())


@pytest.mark.parametrize(("mode", "backend"), [("colocated", "fsdp"), ("shiftable", "fsdp"), ("shiftable", "zero")])
def test_sharded_trainer_on_ray_devices_matches_one_local_device(
    mode, backend, one_device, tiny_checkpoints, tmp_path, ray_cluster
):
    """FSDP2 (or ZeRO-1) over the train devices: colocated keeps one group of four whose shards leave through
    the GPS at every shift out of the train role and come back; shiftable changes the group as the planner
    moves devices. Either way the samples are those of one replicated device, and the update equal to its."""
    extra = ("steps=2", "eval.every=1", f"mode={mode}", "devices=4", "rollout.max_batch=4", f"train.backend={backend}")
    summary = run_job(small_job(tiny_checkpoints, *extra), tmp_path, progress=False)
    many = metrics(tmp_path)
    for a, b in zip(one_device, many, strict=True):
        for key in KEYS:
            assert a[key] == b[key], key
        assert a["heldout_accuracy"] == b["heldout_accuracy"]
        assert b["train_grad_norm"] == pytest.approx(a["train_grad_norm"], rel=1e-4)
    assert summary["steps"] == 2
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    saved = [e for e in events if e["name"] == "train state -> GPS"]
    sizes = [m["train_world_size"] for m in many]
    if mode == "colocated":  # one group of all four; every device left the train role after step 1 with its shard
        assert sizes == [4.0, 4.0]
        assert {e["device"] for e in saved} == {0, 1, 2, 3}
    else:
        assert all(1 <= n <= 4 for n in sizes)
    backward = [e for e in events if e["name"].startswith("accumulate")]
    if backend == "zero":  # each group backpropagated as it came, before its step, on the device it went to
        steps = [e for e in events if e["name"].startswith("step v")]
        assert backward and all(any(e["end"] <= s["start"] for s in steps) for e in backward)
    else:  # in lockstep inside the step
        assert not backward


@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_sharded_bf16_on_a_static_split_keeps_its_group(backend, tiny_checkpoints, tmp_path, ray_cluster):
    extra = ("steps=3", "mode=disaggregated", "devices=4", "split=rollout:1,judge:1,train:2", "rollout.max_batch=4",
             f"train.backend={backend}", "train.precision=bf16", "train.kl_coef=0.05")  # fmt: skip
    if backend == "zero":  # its compute copy is loaded from the weights rollout runs
        extra += ("policy.rollout_dtype=bfloat16",)
    run_job(small_job(tiny_checkpoints, *extra), tmp_path, progress=False)
    many = metrics(tmp_path)
    assert [m["train_world_size"] for m in many] == [2.0, 2.0, 2.0]
    # reported each step (the random judge rewards nothing here, so the policy stays at its reference: the
    # KL term's value against a moved policy is checked in tests/runtime/test_sharded.py)
    assert all(m["train_kl"] >= 0 for m in many)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["name"] == "train state -> GPS"]  # the train set never changed


# one step: the evaluation after it runs on the new version, so the engines reload a version the trainer published
VLLM_BASE = ("steps=1", "eval.every=1", "rollout.max_batch=4")


@pytest.fixture(scope="module")
def vllm_native(vllm_checkpoints, tmp_path_factory) -> Path:
    """The vLLM jobs' reference: their job on one native device."""
    out = tmp_path_factory.mktemp("native")
    run_job(small_job(vllm_checkpoints, *VLLM_BASE), out, progress=False)
    return out


@pytest.mark.parametrize(("tp", "devices"), [(1, 2), (2, 4)])
def test_vllm_devices_match_native_devices(vllm_checkpoints, vllm_native, tmp_path, ray_cluster, tp, devices):
    """Rollout and judge on vLLM beside Ray device actors, shiftable, the trainer sharded over the device
    processes: the samples, rewards and update of one native device; and no process ever builds engines of two
    models (vLLM's sleep allocator is one per process on a GPU): each device's policy and judge engines run in
    processes of their own, apart from the device's. With ``tensor_parallel=2`` on four devices the control
    plane's devices are two instances of two: each engine spans an instance's two devices (vLLM tensor parallel
    over gloo), the roles shift whole instances, and the four devices are the trainer's ranks."""
    native = vllm_native
    extra = (*VLLM_BASE, "mode=shiftable", f"devices={devices}", "train.backend=fsdp", "rollout.backend=vllm",
             "judge.backend=vllm", f"tensor_parallel={tp}")  # fmt: skip
    summary = run_job(small_job(vllm_checkpoints, *extra), tmp_path / "vllm", progress=False)
    for a, b in zip(metrics(native), metrics(tmp_path / "vllm"), strict=True):
        for key in KEYS:
            assert a[key] == b[key], key
        assert a["heldout_accuracy"] == b["heldout_accuracy"]
        assert b["train_grad_norm"] == pytest.approx(a["train_grad_norm"], rel=1e-4)
        assert b["logprob_mismatch"] < 1e-4
    audit = summary["migration_audit"]
    assert audit["identical"] == audit["checked"]
    assert summary["plan"]["audit_migrations"]  # (auto: on with vLLM on a CPU, as the plan gave every device)
    events = [json.loads(x) for x in (tmp_path / "vllm" / "events.jsonl").read_text().splitlines()]
    opened = [e for e in events if e["role"] == "shift" and "engine_pid" in e["args"]]
    models_of: dict[int, set[str]] = {}
    for e in opened:
        models_of.setdefault(e["args"]["engine_pid"], set()).update(e["args"]["engine_builds"].split(","))
        assert e["args"]["engine_pid"] != e["args"]["device_pid"]
    assert all(len(models) == 1 for models in models_of.values()), models_of
    served = {(e["device"], e["args"]["engine_builds"]) for e in opened}
    assert len(models_of) == len(served) and {m for _, m in served} == {"policy", "judge"}
    assert {d for d, _ in served} <= {0, 2} if tp == 2 else True  # (an instance's first device drives its engines)
    whole = {m: 4 * ModelConfig.from_hf(json.loads((p / "config.json").read_text())).num_parameters()
             for m, p in vllm_checkpoints.items()}  # fmt: skip
    for e in opened:  # each rank of a tensor-parallel engine copies its shard of a version (about half), not all
        held = whole[e["args"]["engine_builds"]]
        if tp == 1:
            assert "rank_bytes" not in e["args"] and abs(e["args"]["bytes"] - held) < 0.1 * held
        else:
            assert abs(e["args"]["rank_bytes"] - held / 2) < 0.05 * held and e["args"]["bytes"] > held
    assert summary["plan"]["tensor_parallel"] == tp
    assert sorted(summary.get("instances", {}).values()) == ([0, 0, 1, 1] if tp == 2 else [])  # (as placed)
    shifts: dict[int, list[tuple[str, int]]] = {}
    for e in events:
        if e["role"] == "shift" and "version" in e["args"]:  # (a role's shift, not a state's save)
            shifts.setdefault(e["device"], []).append((e["name"], e["args"]["version"]))
    for first in range(0, devices, tp):  # every device of an instance took every shift of its instance
        assert all(shifts[first] == shifts[d] for d in range(first, first + tp)), shifts
    assert any(len(set(v)) > 1 for v in shifts.values())  # (the roles did shift)
    trace = json.loads((tmp_path / "vllm" / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert names == ({"instance 0", "instance 1"} if tp == 2 else {"pivotrl"})
