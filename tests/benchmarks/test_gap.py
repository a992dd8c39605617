"""The gap benchmark on a small cluster: four what-ifs of one group, the floor's share of each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("modeled", "free shifts", "free migrations", "both free")


def gap(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(ROOT / "benchmarks/gap.py"), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_the_what_ifs_of_one_group_are_measured_side_by_side(tmp_path):
    out = tmp_path / "gap.json"
    argv = ["--groups", "dense-7b", "--gpus", "16", "--tp", "4", "--steps", "3", "--seeds", "0", "1",
            "--set", "rollout.prompts_per_step=64", "--out", str(out)]  # fmt: skip
    proc = gap(*argv)
    assert proc.returncode == 0, proc.stderr
    (group,) = json.loads(out.read_text())["groups"]
    runs = group["variants"]
    assert set(runs) == set(VARIANTS)
    for variant, v in runs.items():
        assert set(v["runs"]) == {"0", "1"} and 0 < v["floor_fraction"] <= 1.0, (variant, v)
        assert v["mean_step_seconds"] == (v["runs"]["0"]["step_seconds"] + v["runs"]["1"]["step_seconds"]) / 2
    shift_s = {variant: v["runs"]["0"]["shift_seconds_per_step"] for variant, v in runs.items()}
    assert shift_s["modeled"] > 0 and shift_s["free shifts"] == shift_s["both free"] == 0
    assert "dense-7b" in proc.stdout


def test_some_rows_only_and_a_trainer_for_every_run(tmp_path):
    """``--variants`` runs those rows alone; ``--set`` reaches every run (here FSDP2 in place of ZeRO-1)."""
    out = tmp_path / "gap.json"
    argv = ["--groups", "dense-7b", "--gpus", "16", "--tp", "4", "--steps", "2", "--variants", "modeled",
            "--set", "rollout.prompts_per_step=32", "train.backend=fsdp", "--out", str(out)]  # fmt: skip
    proc = gap(*argv)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    (group,) = report["groups"]
    assert list(group["variants"]) == ["modeled"]
    run = group["variants"]["modeled"]["runs"]["0"]
    assert run["train_backend"] == "fsdp" and run["step_seconds"] > 0
