"""The steady window of a simulated run: the steps after the first, and the busy time, shifts and moves in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl.sim.steady import steady_window


def write_run(path: Path) -> None:
    """Two devices, three steps ending at 10, 20 and 30 s; the measured window is 10..30."""
    path.mkdir()
    summary = {"samples": 30, "steps": 3, "devices": 2, "steady_samples_per_s": 1.0}
    (path / "summary.json").write_text(json.dumps(summary))
    # step s, shifts, shift s, migrations, rollout s
    steps = [(12.0, 4, 6.0, 0, 11.0), (10.0, 2, 2.0, 1, 7.0), (10.0, 4, 3.0, 3, 8.0)]
    (path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step_seconds": s,
                    "shifts": n,
                    "shift_seconds": x,
                    "migrations": m,
                    "time_s": {"rollout": r, "step": s},
                    "group_wait_s": {"median": r / 2, "p90": r, "max": s},
                }
            )
            + "\n"
            for s, n, x, m, r in steps
        )  # fmt: skip
    )
    spans = [
        (0, "rollout", "rollout 5 done", 0.0, 15.0),  # 5 s in the window
        (1, "train", "step v0->v1", 9.0, 10.0),
        (0, "train", "step v1->v2", 19.0, 20.0),
        (1, "train", "step v1->v2", 19.0, 20.0),
        (1, "shift", "train->judge", 20.0, 22.0),  # a move
        (0, "shift", "rollout->rollout", 20.0, 21.0),  # a weight reload, no move
        (1, "judge", "genrm 3 done", 22.0, 29.0),
        (0, "train", "step v2->v3", 29.0, 30.0),
        (1, "train", "step v2->v3", 29.0, 30.0),
        (0, "rollout", "eval", 30.0, 50.0),  # after the last step: outside
    ]
    (path / "events.jsonl").write_text(
        "".join(
            json.dumps({"device": d, "role": r, "name": n, "start": a, "end": b, "args": {}}) + "\n"
            for d, r, n, a, b in spans
        )  # fmt: skip
    )


def test_steady_window_leaves_out_the_first_step(tmp_path):
    write_run(tmp_path / "run")
    s = steady_window(tmp_path / "run")
    assert s["step_seconds"] == 10.0  # (samples/s is the run's own steady_samples_per_s)
    assert s["busy_fraction"] == pytest.approx({"rollout": 5 / 40, "judge": 7 / 40, "train": 4 / 40, "shift": 3 / 40})
    assert s["idle_fraction"] == pytest.approx(21 / 40)
    assert (s["shifts_per_step"], s["moves_per_step"], s["shift_seconds_per_step"]) == (3.0, 0.5, 2.5)
    assert s["migrations_per_step"] == 2.0
    assert s["rollout_seconds"] == 7.5
    assert s["group_wait_s"] == pytest.approx({"median": 3.75, "p90": 7.5, "max": 10.0})  # the steady steps'
