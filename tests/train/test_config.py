"""TrainConfig's checks when built in Python (the job config's loader names the section too: tests/test_config.py)."""

from __future__ import annotations

import math

import pytest

from pivotrl.train.config import TrainConfig


@pytest.mark.parametrize("name", ["lr", "weight_decay", "eps", "clip_high", "kl_coef", "grad_clip"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_number_that_is_not_finite_is_refused(name, value):
    with pytest.raises(ValueError, match=f"^train.{name} must be a finite number"):
        TrainConfig(**{name: value})


def test_finite_numbers_keep_their_range_message():
    with pytest.raises(ValueError, match=r"^train.lr must be > 0, got -1.0$"):
        TrainConfig(lr=-1.0)
    assert TrainConfig(lr=1e-3, grad_clip=0.0).lr == 1e-3
