"""``benchmarks/paper.py --rerender``: a report's runs kept, its ideals and bounds recomputed, written again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD_MODES = ("colocated", "disaggregated", "shiftable")  # reports before the deployed baseline
ROLES = ("rollout", "judge", "train")


def paper(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(ROOT / "benchmarks/paper.py"), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def fake_report(tmp_path: Path) -> Path:
    """A report of one group run at 32 GPUs, its ideal left out and its overrides those of examples/sim128.yaml,
    as an older report might have them."""
    modes = {m: {"samples_per_s": rate, "step_seconds": 8192 / rate, "busy_fraction": dict.fromkeys(
        (*ROLES, "shift"), 0.2), "idle_fraction": 0.2, "shifts_per_step": 1.0, "moves_per_step": 1.0,
        "shift_seconds_per_step": 1.0} for m, rate in zip(OLD_MODES, (10.0, 8.0, 12.0), strict=True)}  # fmt: skip
    overrides = ["sim.policy_model=Qwen2.5-7B", "sim.judge_model=Qwen2.5-7B", "sim.gpus=32", "sim.instance_gpus=1",
                 "train.backend=zero", "eval.size=16"]  # fmt: skip
    group = {"name": "dense-7b", "what": "dense pair", "policy": "Qwen2.5-7B", "judge": "Qwen2.5-7B", "gpus": 32,
             "instance_gpus": 1, "devices": 32, "overrides": overrides, "ideal": {}, "modes": modes}  # fmt: skip
    report = {"code": "abc", "settings": {"gpus": 32}, "wall_s": 60.0, "groups": [group]}
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(report))
    return path


def test_rerender_recomputes_the_ideal_and_the_bounds_and_keeps_the_runs(tmp_path):
    path = fake_report(tmp_path)
    proc = paper("--rerender", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    g = json.loads((tmp_path / "out.json").read_text())["groups"][0]
    i = g["ideal"]
    assert i["spread_path_s"] > i["critical_path_s"] > 0
    assert i["floor_seconds"] == max(i["step_seconds"], i["spread_path_s"], i["joint_floor_s"], i["group_path_s"])
    ceiling = i["samples_per_s"] * i["step_seconds"] / i["floor_seconds"]
    assert g["bound_vs_colocated"] == pytest.approx(ceiling / 10.0)
    assert g["bound_vs_disaggregated"] == pytest.approx(ceiling / 8.0)
    assert g["speedup_vs_colocated"] == pytest.approx(1.2) and g["modes"]["shiftable"]["samples_per_s"] == 12.0
    assert "spread path" in (tmp_path / "out.md").read_text() and (tmp_path / "out.png").stat().st_size > 0
    assert "dense-7b" in proc.stdout


def test_rerender_refuses_what_is_not_a_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": []}')
    proc = paper("--rerender", str(bad))
    assert proc.returncode != 0 and "not a report of this script" in proc.stderr
