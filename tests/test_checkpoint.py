"""Checkpoints and exact resume: a resumed run writes what the uninterrupted one wrote, after a clean stop or a
SIGKILL of the driver; a corrupted checkpoint is skipped for the one before; a finished run, a changed config or
a run without checkpoints is refused with one line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl import checkpoint as ckpt
from pivotrl.config import load_config
from pivotrl.runtime.job import run_job
from tests.runtime.test_job import small_job

KEYS = ("reward_mean", "accuracy", "response_length", "response_tokens", "judge_tokens", "parse_failures")
ROOT = Path(__file__).resolve().parents[1]


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def drop(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


def same_run(a: Path, b: Path) -> None:
    """Every sample identical, every step's sampled quantities identical, the update equal within rounding."""
    # (how often a sequence migrated is the schedule's, which wall-clock timing decides; what it produced is not)
    assert [drop(r, "migrations") for r in rows(a / "samples.jsonl")] == [
        drop(r, "migrations") for r in rows(b / "samples.jsonl")
    ]
    ma, mb = rows(a / "metrics.jsonl"), rows(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb, strict=True):
        for key in KEYS:
            assert x[key] == y[key], (x["step"], key)
        assert x.get("heldout_accuracy") == y.get("heldout_accuracy")
        assert y["train_grad_norm"] == pytest.approx(x["train_grad_norm"], rel=1e-4)


@pytest.fixture(scope="module")
def uninterrupted(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    run_job(small_job(tiny_checkpoints, "steps=5", "checkpoint.every=2", "eval.every=2"), out, progress=False)
    return out


def test_a_run_writes_checkpoints_that_load_as_models(uninterrupted):
    found = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert found == ["step_000002", "step_000004"]  # every 2 steps, none after the last
    latest = ckpt.latest(uninterrupted)
    assert latest.step == 4 and latest.state["controller"]["version"] == 4
    assert ckpt.verify(latest.path) is None
    from pivotrl.model import load_model

    model, _ = load_model(latest.path / "policy")  # an ordinary HF checkpoint of version 4
    assert sum(p.numel() for p in model.parameters()) > 0
    kinds = sorted(e["kind"] for e in latest.state["entries"])
    assert kinds == ["optimizer", "weights"]  # the replicated trainer's AdamW state comes along


def test_resume_continues_as_the_uninterrupted_run(uninterrupted, tmp_path, tiny_checkpoints):
    """A run stopped after step 5 with only its files: resumed from step 4, it writes steps 5 again the same."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "summary.json").unlink()  # as if the driver died before the end
    shutil.rmtree(run / "checkpoints" / "step_000004")  # go back further: resume from step 2
    summary = run_job(load_config(run / "config.json"), run, progress=False, resume=True)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 5
    same_run(uninterrupted, run)


def test_an_overlapping_run_resumes_as_the_uninterrupted_one(tiny_checkpoints, tmp_path):
    """max_staleness=1: steps overlap, but the step a checkpoint follows is trained before the next begins, so
    the checkpoint holds no step in flight and the resumed run overlaps the rest as the uninterrupted one did."""
    whole = tmp_path / "whole"
    job = small_job(tiny_checkpoints, "steps=5", "checkpoint.every=2", "eval.every=2", "max_staleness=1",
                    "train.correction=tis")  # fmt: skip
    run_job(job, whole, progress=False)
    lags = [m["staleness_max"] for m in rows(whole / "metrics.jsonl")]
    assert lags[0] == 0 and max(lags) == 1  # (steps 2 and 4 begin beside steps 1 and 3)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step_000004")  # resume from step 2
    summary = run_job(load_config(run / "config.json"), run, progress=False, resume=True)
    assert summary["resumed_from_step"] == 2
    same_run(whole, run)


def test_a_corrupted_checkpoint_falls_back_to_the_one_before(uninterrupted, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    weights = next((run / "checkpoints" / "step_000004" / "gps").glob("*weights.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest(run).step == 2
    assert "step_000004 skipped" in caplog.text and "fails its checksum" in caplog.text


def test_refusals_name_the_reason(uninterrupted, tmp_path, tiny_checkpoints):
    with pytest.raises(ckpt.CheckpointError, match="finished all 5 steps"):
        run_job(load_config(uninterrupted / "config.json"), uninterrupted, progress=False, resume=True)
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "summary.json").unlink()
    changed = load_config(run / "config.json", ["train.lr=1e-3", "seed=3"])
    with pytest.raises(ckpt.CheckpointError, match=r"config differs from the run's \(seed, train.lr\)"):
        run_job(changed, run, progress=False, resume=True)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        run_job(load_config(run / "config.json"), run, progress=False, resume=True)


def test_resume_after_the_driver_is_killed(uninterrupted, tmp_path, tiny_checkpoints):
    """SIGKILL of `pivotrl train` once a checkpoint is on disk, then `pivotrl train --resume`: the run's files are
    those of the uninterrupted run."""
    run = tmp_path / "run"
    cfg = json.loads((uninterrupted / "config.json").read_text())
    config = tmp_path / "job.json"
    config.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pivotrl.cli", "train", str(config), "--out", str(run), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_000002" / "manifest.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists()
    done = subprocess.run(
        [sys.executable, "-m", "pivotrl.cli", "train", "--resume", str(run), "--quiet"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    same_run(uninterrupted, run)
    again = subprocess.run(
        [sys.executable, "-m", "pivotrl.cli", "train", "--resume", str(run)], env=env, capture_output=True, text=True
    )
    assert again.returncode == 2 and "nothing to resume" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_a_sharded_trainer_resumes_from_its_shards(backend, tiny_checkpoints, tmp_path, ray_cluster):
    """FSDP (or ZeRO-1) over Ray devices: each rank's shard of the AdamW state goes into the checkpoint (as the
    group that stepped wrote it) and the resumed group of the same size reads it back: the same run."""
    extra = ("steps=4", "checkpoint.every=2", "eval.every=2", "mode=colocated", "devices=2", "rollout.max_batch=4",
             f"train.backend={backend}")  # fmt: skip
    whole = tmp_path / "whole"
    run_job(small_job(tiny_checkpoints, *extra), whole, progress=False)
    state = ckpt.latest(whole).state
    assert state["train_state_world"] == 2
    assert state["train_backend"] == backend  # (what a resumed run trains with, whatever auto would take then)
    assert sorted(e["name"] for e in state["entries"]) == ["policy", "policy.shard0of2", "policy.shard1of2"]
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    (run / "summary.json").unlink()
    summary = run_job(load_config(run / "config.json"), run, progress=False, resume=True)
    assert summary["resumed_from_step"] == 2
    same_run(whole, run)


def test_a_run_written_before_new_keys_existed_resumes(uninterrupted, tmp_path):
    """Keys added to the config since the run was written take their defaults when it is compared."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "summary.json").unlink()
    latest = ckpt.latest(run)
    state = json.loads((latest.path / "state.json").read_text())
    del state["config"]["rollout"]["audit_migrations"], state["config"]["train"]["recompute_logprobs"]
    (latest.path / "state.json").write_text(json.dumps(state))
    manifest = json.loads((latest.path / "manifest.json").read_text())
    manifest["state.json"] = ckpt._sha256(latest.path / "state.json")
    (latest.path / "manifest.json").write_text(json.dumps(manifest))
    summary = run_job(load_config(run / "config.json"), run, progress=False, resume=True)
    assert summary["resumed_from_step"] == 4
    same_run(uninterrupted, run)
