"""``benchmarks/reach.py``: the replays of a group written as rows; a refused run writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=64"]  # 16 GPUs in instances of 4, 1,024 responses


def reach(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(ROOT / "benchmarks/reach.py"), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_the_script_writes_its_rows_and_refuses_an_empty_batch_or_cohort(tmp_path):
    out = tmp_path / "reach.json"
    proc = reach("--groups", "dense-7b", "--gpus", "16", "--tp", "4", "--targets", "16", "64", "--set", *SMALL,
                 "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["groups"]
    assert row["name"] == "dense-7b" and set(row["batched"]) == {"16", "64"} and row["shiftable_seconds"] is None
    assert "dense-7b" in proc.stdout
    for bad in (["--targets", "0"], ["--cohort", "-1"], ["--shiftable-steps", "1"]):
        assert reach(*bad, "--out", str(out)).returncode == 2
    assert json.loads(out.read_text())["groups"] == [row]  # (a refused run writes nothing over the report)


def test_shiftable_is_simulated_beside_the_replay_when_asked(tmp_path):
    out = tmp_path / "reach.json"
    proc = reach("--groups", "dense-7b", "--gpus", "16", "--tp", "4", "--targets", "64", "--shiftable-steps", "2",
                 "--set", *SMALL, "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["groups"]
    assert row["shiftable_seconds"] >= row["floor_seconds"] > 0  # (a run does not pass the floor)
