"""End to end on Ray: 4 CPU devices, colocated and disaggregated, against one local device."""

import json

import pytest

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
        assert roles == {0: {"rollout"}, 1: {"rollout"}, 2: {"genrm"}, 3: {"train"}}
        # sequences may move between the two rollout devices (rebalancing, when their loads part), never elsewhere
        assert {e["device"] for e in events if e["role"] == "migrate"} <= {0, 1}
    json.loads((tmp_path / "trace.json").read_text())
