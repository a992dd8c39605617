"""``pivotrl plan``: the step as the job's mode runs it, a run's measurements read with every mistake named,
and splits that never complete said so (in JSON too, which has no infinity)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.plan import format_report, plan_report

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples/default.yaml")


def report_of(*overrides: str, run_dir: Path | None = None) -> dict:
    return plan_report(load_config(CONFIG, overrides), run_dir)


def test_disaggregated_estimates_the_default_split_and_recommends_only_splits_that_train():
    """It recommended rollout:2, judge:2, train:0, which split= refuses and which cannot train."""
    report = report_of("mode=disaggregated", "devices=4")
    assert report["split"] == {"rollout": 2, "judge": 1, "train": 1} and not report["split_given"]
    assert report["timeline"]["split"] == "r2 j1 t1"
    assert min(report["recommended"].values()) >= 1
    assert report["estimates"] and all("0" not in e["split"] for e in report["estimates"])  # (r0, g0, t0)
    text = format_report(report)
    assert "split: rollout:2,judge:1,train:1 (the default; split= sets another)" in text
    assert "recommended start split" not in text


def test_disaggregated_estimates_the_split_given():
    report = report_of("mode=disaggregated", "devices=5", "split=rollout:1,judge:2,train:2")
    assert report["split"] == {"rollout": 1, "judge": 2, "train": 2} and report["split_given"]
    assert report["timeline"]["timeline"].startswith("r1 j2 t2: rollout ")
    # no device changes role: the static split is slower than the same start split in shiftable mode
    shiftable = report_of("devices=5")["estimates"]
    assert report["timeline"]["seconds"] > min(e["seconds"] for e in shiftable)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["split=rollout:2,judge:1,train:1"], "split: only used with mode=disaggregated"),
        (["mode=colocated", "split=rollout:2,judge:1,train:1"], "split: only used with mode=disaggregated"),
        (["mode=disaggregated", "devices=2"], "disaggregated mode needs at least 3 devices"),
        (["mode=disaggregated", "split=rollout:2,judge:1,train:2"], "uses 5 devices, but devices=4"),
    ],
)
def test_a_layout_train_refuses_is_refused(overrides, message, capsys):
    with pytest.raises(UserError, match=message):
        report_of(*overrides)
    assert main(["plan", CONFIG, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_colocated_runs_every_phase_on_every_device():
    report = report_of("mode=colocated", "devices=4")
    assert "recommended" not in report and report["timeline"]["split"] == "r4 j0 t0"
    text = format_report(report)
    assert "every device generates, then judges, then trains (phases end at): rollout " in text


def test_a_split_that_never_completes_is_infeasible_not_infinitely_slow(capsys):
    report = report_of("devices=1")
    never = [e for e in report["estimates"] if e["seconds"] is None]
    assert never and all(set(e["phases"].values()) == {None} for e in never)
    json.dumps(report, allow_nan=False)  # (Infinity is not JSON)
    text = format_report(report)
    assert "r0 j0 t1: infeasible, the step never completes (no device generates)" in text
    assert "infs" not in text and "inf " not in text
    assert main(["plan", CONFIG, "devices=1", "--json"]) == 0
    assert "Infinity" not in capsys.readouterr().out


def test_the_marked_trainer_is_named_for_what_it_is(tiny_checkpoints):
    policy = f"policy.path={tiny_checkpoints['policy']}"  # (a config.json to read: models/ is built by prepare)
    assert "(* what train.backend=auto takes for this job on such GPUs)" in format_report(report_of(policy))
    text = format_report(report_of(policy, "train.backend=fsdp"))
    assert "(* train.backend=fsdp, as configured)" in text and "auto" not in text.splitlines()[-1]


def write_run(where: Path, metrics: str, events: str) -> Path:
    where.mkdir()
    (where / "metrics.jsonl").write_text(metrics)
    (where / "events.jsonl").write_text(events)
    return where


METRICS = '{"response_tokens": 400, "response_length": 20.0, "judge_tokens": 900, "time_s": {"train": 2.0}}\n'
EVENTS = '{"role": "rollout", "start": 0.0, "end": 1.0}\n{"role": "judge", "start": 1.0, "end": 2.5}\n'


@pytest.mark.parametrize(
    ("metrics", "events", "message"),
    [
        ("", EVENTS, "metrics.jsonl has no steps"),
        ("\n", EVENTS, "metrics.jsonl has no steps"),
        (
            METRICS,
            EVENTS + '{"role": "rollout", "start": 1\n',
            "events.jsonl line 3: not JSON (Expecting ',' delimiter: column 31)",
        ),
        (
            METRICS + '{"step": "1\n',
            EVENTS,
            "metrics.jsonl line 2: not JSON (Unterminated string starting at: column 10)",
        ),
        (METRICS + "[1]\n", EVENTS, "metrics.jsonl line 2: expected a JSON object, got list"),
        ('{"response_tokens": 400}\n', EVENTS, "metrics.jsonl line 1: no number at 'response_length'"),
        (METRICS, '{"start": 0.0, "end": 1.0}\n', "events.jsonl line 1: no 'role'"),
    ],
)
def test_a_profile_that_cannot_be_read_is_named_with_its_line(tmp_path, capsys, metrics, events, message):
    run = write_run(tmp_path / "run", metrics, events)
    with pytest.raises(UserError, match=re.escape(message)):
        report_of(run_dir=run)
    assert main(["plan", CONFIG, "--profile", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_profile_without_events_is_named(tmp_path):
    run = write_run(tmp_path / "run", METRICS, EVENTS)
    assert report_of(run_dir=run)["source"] == str(run)
    (run / "events.jsonl").unlink()
    with pytest.raises(UserError, match="events.jsonl not found"):
        report_of(run_dir=run)


def test_with_device_memory_the_train_devices_at_the_step_are_those_a_run_takes(tmp_path, capsys):
    """train.min_devices=auto on 80 GB devices: a 7B policy's FSDP2 state needs 3 at the step (as `train` resolves
    it), so a split with one train device is refused as `train` refuses it, the default split keeps 3, and a job
    whose devices cannot hold it at all is refused with what would help."""
    from pivotrl.model.config import ModelConfig
    from pivotrl.sim.models import MODELS

    shape: ModelConfig = MODELS["Qwen2.5-7B"].train_config()
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf("bfloat16")))
    policy = f"policy.path={tmp_path}"

    def plan(*extra: str) -> dict:
        return plan_report(load_config(CONFIG, [policy, *extra]), device_gb=80.0)

    with pytest.raises(UserError, match=r"train:1 is fewer than the 3 devices the optimizer step needs"):
        plan("mode=disaggregated", "split=rollout:2,judge:1,train:1")
    report = plan("mode=disaggregated", "devices=8")
    assert report["min_train_devices"] == 3 and report["split"]["train"] >= 3
    assert all(int(e["split"].split("t")[-1]) >= 3 for e in report["estimates"])
    with pytest.raises(UserError, match=r"min_devices=auto: .* even on all 2 devices, more than 90% of their 80 GB"):
        plan("devices=2")
    assert main(["plan", CONFIG, policy, "--device-memory-gb", "inf"]) == 2
    assert "must be a finite number > 0" in capsys.readouterr().err
