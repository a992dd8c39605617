"""The planner's estimates read against a run: the plans nearest each point of a step's rollout."""

from __future__ import annotations

import pytest

from pivotrl.config import ConfigError
from pivotrl.control import planner as planner_module
from pivotrl.sim.estimate import AT, errors, recorded_run
from pivotrl.sim.groups import BASE


def test_errors_read_the_plans_nearest_each_point_of_the_steady_steps():
    # two steps back to back: 0-100 s (rollout 80 s) and 100-190 s (rollout 40 s)
    steps = [{"time_s": {"rollout": 80.0}, "step_seconds": 100.0}, {"time_s": {"rollout": 40.0}, "step_seconds": 90.0}]
    plans = [
        (20.0, 70.0, 90.0),  # step 1: left out (its plans run on priors)
        (109.0, 135.0, 180.0),  # near a quarter of step 2's rollout (110 s): 5 s early, 10 s early
        (121.0, 140.0, 195.0),  # near half of it (120 s): on time, 5 s late
        (131.0, 141.0, 190.0),  # near three quarters (130 s)
        (150.0, 150.0, 191.0),  # after its rollout: not read
    ]
    out = errors(plans, steps)
    assert out == {0.25: [(-5.0, -10.0)], 0.5: [(0.0, 5.0)], 0.75: [(1.0, 0.0)]}
    assert errors(plans[:1], steps) == {at: [] for at in AT}


def test_a_recorded_run_puts_the_planner_back():
    plan = planner_module.Planner.plan
    with pytest.raises(ConfigError, match="sim.gpus"):  # a job that cannot run
        recorded_run(BASE, ["sim.gpus=0"])
    assert planner_module.Planner.plan is plan
