"""A device lost mid-run on Ray (fault.*): killed in each phase, or hung past device_timeout. The run goes on:
every sample of every step once, the same tokens and rewards as an undisturbed run, the same update. What
cannot be recovered (a device lost inside the optimizer step) stops the run with one line saying how to
resume it, and the resume completes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pivotrl.errors import RunInterrupted
from pivotrl.model import load_model
from pivotrl.runtime.job import run_job
from tests.runtime.test_job import small_job

BASE = ("steps=2", "eval.every=0", "rollout.max_batch=4", "checkpoint.every=1")
RAY = (*BASE, "mode=shiftable", "devices=4")


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def undisturbed(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("undisturbed")
    run_job(small_job(tiny_checkpoints, *BASE), out, progress=False)
    return out


# a hung device is lost after device_timeout; a healthy one's call on a machine busy with other work can take
# several seconds, so the timeout that tells them apart leaves it room
HANG_S = 20


def assert_same_run(a: Path, b: Path) -> None:
    sa, sb = rows(a / "samples.jsonl"), rows(b / "samples.jsonl")
    key = lambda r: (r["step"], r["uid"])  # noqa: E731
    assert sorted(map(key, sb)) == sorted(map(key, sa))  # every sample once: none lost, none twice
    by = {key(r): r for r in sa}
    for r in sb:
        assert (r["response_ids"], r["reward"]) == (by[key(r)]["response_ids"], by[key(r)]["reward"])
    pa, _ = load_model(a / "policy")
    pb, _ = load_model(b / "policy")
    for (name, x), y in zip(pa.state_dict().items(), pb.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=0), name


@pytest.mark.parametrize(
    "phase,step", [("rollout", 1), ("judge", 1), ("backward", 2), ("optimizer", 1), ("optimizer", 2), ("shift", 2)]
)
def test_a_device_killed_mid_phase_costs_nothing(phase, step, undisturbed, tiny_checkpoints, tmp_path, ray_cluster):
    fault = ("fault.first=true", f"fault.phase={phase}", f"fault.step={step}")  # whichever device does it
    summary = run_job(small_job(tiny_checkpoints, *RAY, *fault), tmp_path, progress=False)
    assert len(summary["devices_lost"]) == 1
    assert "died" in summary["devices_lost"][0]["reason"]
    assert_same_run(undisturbed, tmp_path)


def test_a_zero_trainer_device_killed_mid_backward_costs_nothing(undisturbed, tiny_checkpoints, tmp_path, ray_cluster):
    """train.backend=zero: the lost device's gradient sums go with it, and the groups it held are backpropagated
    again on the others; if it also held its shard of the master weights (it stepped last and stayed in the train
    role), the job resumes from its checkpoint. Either way the update is the undisturbed (replicated) run's."""
    fault = ("fault.first=true", "fault.phase=backward", "fault.step=2", "train.backend=zero")
    summary = run_job(small_job(tiny_checkpoints, *RAY, *fault), tmp_path, progress=False)
    assert len(summary["devices_lost"] or summary["auto_resumed"]) == 1
    assert_same_run(undisturbed, tmp_path)


def test_a_hung_device_times_out_and_is_handled_the_same(undisturbed, tiny_checkpoints, tmp_path, ray_cluster):
    fault = ("fault.first=true", "fault.phase=rollout", "fault.step=2", "fault.kind=hang", f"device_timeout={HANG_S}")
    summary = run_job(small_job(tiny_checkpoints, *RAY, *fault), tmp_path, progress=False)
    assert len(summary["devices_lost"]) == 1
    assert f"device_timeout={HANG_S}" in summary["devices_lost"][0]["reason"]
    assert_same_run(undisturbed, tmp_path)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        # hung inside its part, before its first collective (as on a hung kernel), while rank 0's call, sent
        # first, is the first past device_timeout, waiting in that collective: asked how far each got, the
        # driver loses device 1, not rank 0
        (
            ("fault.step=2", "fault.kind=hang", f"device_timeout={HANG_S}"),
            "entered 0 collective(s), while the other members",
        ),
        # killed as it is sent its part of step 1's optimizer step, a new group's first: rank 0, waiting for it
        # at the rendezvous, is told to give up (torch's own wait would last its whole timeout)
        (("fault.step=1",), "died"),
    ],
    ids=["hung-inside", "killed-before-meeting"],
)
def test_a_member_other_than_rank_zero_lost_in_the_optimizer_step_is_the_only_one_lost(
    fault, reason, undisturbed, tiny_checkpoints, tmp_path, ray_cluster
):
    """Device 1 of a two-device group fails in the optimizer step; the step is done again with it started
    afresh, and the run is the undisturbed one."""
    fault = ("mode=colocated", "devices=2", "fault.device=1", "fault.phase=optimizer", *fault)
    summary = run_job(small_job(tiny_checkpoints, *BASE, *fault), tmp_path, progress=False)
    assert [e["device"] for e in summary["devices_lost"]] == [1]
    assert reason in summary["devices_lost"][0]["reason"]
    assert_same_run(undisturbed, tmp_path)


@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_a_lost_shard_of_the_sharded_train_state_resumes_the_run_from_its_checkpoint(
    backend, undisturbed, tiny_checkpoints, tmp_path, ray_cluster
):
    """FSDP (or ZeRO-1): the device's shard of the master weights and AdamW state is nowhere else; the job
    resumes itself from its newest checkpoint on devices started afresh and ends as the undisturbed run."""
    fault = ("fault.first=true", "fault.phase=optimizer", "fault.step=2", f"train.backend={backend}")
    summary = run_job(small_job(tiny_checkpoints, *RAY, *fault), tmp_path, progress=False)
    assert [a["from"] for a in summary["auto_resumed"]] == ["checkpoint"]
    assert "optimizer step of step 2" in summary["auto_resumed"][0]["reason"]
    assert summary["resumed_from_step"] == 1
    assert_same_run(undisturbed, tmp_path)


def test_without_restarts_the_run_stops_with_the_line_to_resume_it(
    undisturbed, tiny_checkpoints, tmp_path, ray_cluster
):
    fault = ("fault.first=true", "fault.phase=optimizer", "fault.step=2", "train.backend=fsdp", "restart_lost=false")
    with pytest.raises(RunInterrupted, match=r"optimizer step of step 2.*--resume .*newest checkpoint: step_000001"):
        run_job(small_job(tiny_checkpoints, *RAY, *fault), tmp_path, progress=False)
    from pivotrl.config import load_config

    summary = run_job(load_config(tmp_path / "config.json"), tmp_path, progress=False, resume=True)
    assert summary["resumed_from_step"] == 1 and not summary["devices_lost"]  # the drill is not replayed
    assert_same_run(undisturbed, tmp_path)


def test_a_device_lost_for_good_leaves_the_run_to_the_others(tiny_checkpoints, tmp_path, ray_cluster):
    """restart_lost=false: the lost device does not come back; colocated on two devices, the run completes on
    the one left."""
    cfg = small_job(tiny_checkpoints, *BASE, "mode=colocated", "devices=2", "fault.device=1", "fault.phase=rollout",
                    "fault.step=2", "restart_lost=false")  # fmt: skip
    summary = run_job(cfg, tmp_path, progress=False)
    assert [e["device"] for e in summary["devices_lost"]] == [1] and summary["steps"] == 2
