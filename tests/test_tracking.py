"""TensorBoard and W&B tracking, read back with each tool's own reader: TensorBoard's EventAccumulator, and
wandb's record format (its protobuf ``Record`` in its transaction log) for an offline run."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from pivotrl import tracking
from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.runtime.job import run_job
from tests.runtime.test_job import small_job

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

BOTH = ("log.tensorboard=true", "log.wandb=true")


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, and every file wandb keeps outside the run directory kept under tmp_path."""
    for name, folder in (("WANDB_DIR", "dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / folder))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-home" / "data"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


def events(run_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar_steps(acc: Any, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log chunks
    (checksum, length, type: full/first/middle/last) in blocks of 32 KiB, each record a wandb ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _items(items: Any) -> dict[str, Any]:
    return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


def wandb_run(path: Path) -> dict[str, Any]:
    """run id, config, history rows (by step) and the summary of one offline run directory."""
    (file,) = path.glob("run-*.wandb")
    run: dict[str, Any] = {"history": {}, "summary": {}, "config": {}}
    for r in wandb_records(file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run["id"] = r.run.run_id
            run["name"] = r.run.display_name
            run["config"] = _items(r.run.config.update)
        elif kind == "history":
            row = _items(r.history.item)
            run["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "summary":
            run["summary"].update(_items(r.summary.update))
    return run


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_scalars_are_the_finite_numbers_of_a_row_with_nested_keys_joined():
    row = {"reward_mean": 0.5, "shifts": 3, "time_s": {"rollout": 1.5, "judge": {"queue": 2}}, "ok": True}
    row |= {"mode": "colocated", "moves": [1, 2], "train_kl": float("nan"), "n": None}
    assert tracking.scalars(row) == {"reward_mean": 0.5, "shifts": 3, "time_s/rollout": 1.5, "time_s/judge/queue": 2}
    assert tracking.scalars({"a": {"b": 1}}, "summary/") == {"summary/a/b": 1}


@pytest.mark.parametrize("key,module", [("log.tensorboard", "tensorboard"), ("log.wandb", "wandb")])
def test_a_backend_not_installed_stops_the_job_before_it_starts(key, module, tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec finds nothing
    with pytest.raises(UserError) as e:
        run_job(small_job(tiny_checkpoints, f"{key}=true"), tmp_path / "run", progress=False)
    assert str(e.value) == (
        f"{key}=true: {module} is not installed here; install it with pip install {module} "
        f"(or pip install 'pivotrl[tracking]'), or set {key}=false"
    )
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_resume_rewrites_the_steps_after_its_checkpoint_in_the_same_runs(tmp_path, wandb_env):
    """Tracker alone: steps 1-3, then a resume from step 1 that writes 2-3 again with other values. TensorBoard
    shows each step once, with the values written last; W&B logs both parts under one run id."""
    from PIL import Image

    cfg = load_config(None, [*BOTH, "log.wandb_run_name=trial"])
    picture = tmp_path / "timeline.png"
    Image.new("RGB", (40, 10), (255, 0, 0)).save(picture)
    first = tracking.start(cfg, tmp_path)
    for step in (1, 2, 3):
        first.step({"step": step, "reward_mean": step / 10, "time_s": {"rollout": float(step)}})
    first.close(failed=True)  # the run stopped
    again = tracking.start(cfg, tmp_path, resumed_at=1)
    for step in (2, 3):
        again.step({"step": step, "reward_mean": step, "time_s": {"rollout": 10.0 * step}})
    again.finish({"steps": 3, "mode": "colocated", "shift_seconds": {"max": 0.25}}, picture)

    acc = events(tmp_path)
    assert scalar_steps(acc, "reward_mean") == pytest.approx({1: 0.1, 2: 2.0, 3: 3.0})
    assert scalar_steps(acc, "time_s/rollout") == pytest.approx({1: 1.0, 2: 20.0, 3: 30.0})
    assert scalar_steps(acc, "summary/shift_seconds/max") == {3: 0.25}
    (image,) = acc.Images("timeline")
    assert (image.step, image.width, image.height) == (3, 40, 10)

    a, b = (wandb_run(p) for p in offline_runs(tmp_path))
    assert a["id"] == b["id"] == (tmp_path / "wandb" / "run_id").read_text().strip()
    assert a["name"] == "trial" and a["config"]["log"]["wandb"] is True
    assert {s: r["reward_mean"] for s, r in a["history"].items()} == {1: 0.1, 2: 0.2, 3: 0.3}
    assert {s: r["time_s/rollout"] for s, r in b["history"].items()} == {2: 20.0, 3: 30.0}
    image = b["history"][3]
    assert image["timeline/_type"] == "image-file" and (image["timeline/width"], image["timeline/height"]) == (40, 10)
    assert (offline_runs(tmp_path)[-1] / "files" / image["timeline/path"]).is_file()
    assert b["summary"]["summary/steps"] == 3 and b["summary"]["summary/shift_seconds/max"] == 0.25
    assert "summary/mode" not in b["summary"]


def test_a_job_sends_its_rows_summary_and_timeline_and_a_resume_goes_on_in_the_same_runs(
    tiny_checkpoints, tmp_path, wandb_env
):
    run = tmp_path / "run"
    cfg = small_job(tiny_checkpoints, "steps=2", "checkpoint.every=1", *BOTH)
    summary = run_job(cfg, run, progress=False)
    rows = metrics(run)
    acc = events(run)
    for row in rows:  # every number of every row, at its step
        for tag, value in tracking.scalars({k: v for k, v in row.items() if k != "step"}).items():
            assert scalar_steps(acc, tag)[row["step"]] == pytest.approx(value), tag
    assert "time_s/rollout" in acc.Tags()["scalars"] and "step" not in acc.Tags()["scalars"]
    assert scalar_steps(acc, "summary/samples_per_s") == pytest.approx({2: summary["samples_per_s"]})
    assert len(acc.Images("timeline")) == 1

    (offline,) = offline_runs(run)
    first = wandb_run(offline)
    assert first["name"] == "run" and first["config"]["steps"] == 2
    for row in rows:
        logged = first["history"][row["step"]]
        assert logged["reward_mean"] == pytest.approx(row["reward_mean"])
        assert logged["time_s/rollout"] == pytest.approx(row["time_s"]["rollout"])
    assert first["history"][2]["timeline/_type"] == "image-file"
    assert first["summary"]["summary/samples"] == summary["samples"]

    (run / "summary.json").unlink()  # as if the run had stopped after its checkpoint of step 1
    resumed = run_job(load_config(run / "config.json"), run, progress=False, resume=True)
    assert resumed["resumed_from_step"] == 1
    acc = events(run)
    assert sorted(scalar_steps(acc, "reward_mean")) == [1, 2]  # step 2 once, from the resumed part
    assert scalar_steps(acc, "response_tokens")[2] == metrics(run)[1]["response_tokens"]
    again = wandb_run(offline_runs(run)[-1])
    assert again["id"] == first["id"] and sorted(again["history"]) == [2]


def test_a_resume_may_turn_tracking_on(tiny_checkpoints, tmp_path):
    run = tmp_path / "run"
    run_job(small_job(tiny_checkpoints, "steps=2", "checkpoint.every=1"), run, progress=False)
    (run / "summary.json").unlink()
    run_job(load_config(run / "config.json", ["log.tensorboard=true"]), run, progress=False, resume=True)
    assert sorted(scalar_steps(events(run), "reward_mean")) == [2]
