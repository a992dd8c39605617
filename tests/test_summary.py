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
