"""The gap benchmark on a small cluster: four what-ifs of one group, the floor's share of each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts import their neighbours

import gap  # noqa: E402


def test_the_what_ifs_of_one_group_are_measured_side_by_side(tmp_path, capsys):
    out = tmp_path / "gap.json"
    argv = ["--groups", "dense-7b", "--gpus", "16", "--tp", "4", "--steps", "3", "--seeds", "0", "1",
            "--set", "rollout.prompts_per_step=64", "--out", str(out)]  # fmt: skip
    assert gap.main(argv) == 0
    (group,) = json.loads(out.read_text())["groups"]
    runs = group["variants"]
    assert set(runs) == set(gap.VARIANTS)
    for variant, row in runs.items():
        assert {"0", "1"} <= set(row) and 0 < row["floor_fraction"] <= 1.0, (variant, row)
        assert row["mean_step_seconds"] == (row["0"]["step_seconds"] + row["1"]["step_seconds"]) / 2
    assert runs["modeled"]["0"]["shift_seconds_per_step"] > 0
    assert runs["free shifts"]["0"]["shift_seconds_per_step"] == runs["both free"]["0"]["shift_seconds_per_step"] == 0
    assert "dense-7b" in capsys.readouterr().out
