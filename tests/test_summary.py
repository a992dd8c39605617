"""The run summary's steady throughput: samples per second over the steps after the first."""

from __future__ import annotations

import pytest

from pivotrl.summary import steady_rate


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        pytest.param([50.0, 10.0, 10.0], 10.0, id="first-step-left-out"),
        pytest.param([20.0], 5.0, id="one-step-is-its-own-window"),
        pytest.param([5.0, 0.0], 0.0, id="no-time-no-rate"),
    ],
)
def test_steady_rate(seconds, expected):
    assert steady_rate([{"step_seconds": s} for s in seconds], per_step=100) == expected


def test_the_steady_rate_of_overlapping_steps_is_the_spacing_of_their_updates():
    """Overlapping steps' own times overlap (each from its begin to its update): summed they would count the
    same seconds twice. Their updates at 30, 40, 50 s: two steps of 100 in 20 s. A resumed run's clock begins
    again: its rows fall back to the steps' own times."""
    rows = [{"step_seconds": 30.0, "at_s": {"end": 30.0}}, {"step_seconds": 18.0, "at_s": {"end": 40.0}},
            {"step_seconds": 19.0, "at_s": {"end": 50.0}}]  # fmt: skip
    assert steady_rate(rows, per_step=100) == 10.0
    resumed = [rows[0], {"step_seconds": 20.0, "at_s": {"end": 8.0}}, {"step_seconds": 20.0, "at_s": {"end": 18.0}}]
    assert steady_rate(resumed, per_step=100) == 5.0


def test_the_share_of_generating_time_spent_waiting_for_the_driver():
    from pivotrl.summary import driver_wait
    from pivotrl.telemetry import Slice

    def gen(device: int, start: float, end: float, running: int, finished: int, role: str = "rollout") -> Slice:
        return Slice(device, role, "x", start, end, {"running": running, "finished": finished})

    slices = [
        gen(0, 0.0, 1.0, 4, 1),  # 3 left: the gap to the next slice is a wait (0.5)
        gen(0, 1.5, 2.5, 3, 3),  # none left: the gap after it is not (the device had nothing to do)
        gen(0, 5.0, 6.0, 2, 0),  # 2 left, but a shift comes next: no wait
        Slice(0, "shift", "rollout->judge", 6.2, 6.4),
        gen(1, 0.0, 2.0, 1, 0, "judge"),  # device 1: back to back
        gen(1, 2.0, 3.0, 1, 1, "judge"),
        gen(2, 0.0, 1.0, 2, 0),  # device 2: a command took the gap, and a little more
        Slice(2, "rollout", "x", 1.3, 2.0, {"running": 2, "finished": 2, "commands_s": 0.4}),
    ]
    got = driver_wait(slices)
    assert got["max"] == pytest.approx(0.5 / 3.5) and got["mean"] == pytest.approx(0.5 / 3.5 / 3)
    assert driver_wait([Slice(0, "train", "step", 0.0, 1.0)]) == {"mean": 0.0, "max": 0.0}
