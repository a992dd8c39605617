"""The search over allocations: which splits a plan weighs, and how close it comes to the best."""

from __future__ import annotations

import pytest

from pivotrl.control.planner import (
    PhaseModel,
    Planner,
    initial_split,
    summarize,
)
from pivotrl.control.planner.search import allocations
from tests.control.planner.cases import (
    EARLY,
    JUDGE_BURST,
    MAX_BATCH,
    REWARDS_IN,
    TAIL,
    G,
    R,
    T,
    profiles,
)

SPLITS = [
    pytest.param(EARLY, 4, (4, 0, 0), id="step-start:everyone-rolls-out-then-hands-on"),
    pytest.param(JUDGE_BURST, 4, (0, 4, 0), id="judge-burst:all-judge-then-train"),
    pytest.param(REWARDS_IN, 4, (0, 0, 4), id="train-only"),
    pytest.param(EARLY, 1, (1, 0, 0), id="one-device"),
]


@pytest.mark.parametrize(("workload", "devices", "expected"), SPLITS)
def test_initial_split(workload, devices, expected):
    split = initial_split(workload, profiles(), devices, MAX_BATCH)
    assert (split[R], split[G], split[T]) == expected
    assert sum(split.values()) == devices


@pytest.mark.parametrize("workload", [TAIL, JUDGE_BURST, EARLY], ids=["tail", "burst", "early"])
def test_many_devices_are_searched_coarse_to_fine_close_to_the_optimum(workload):
    import time

    n, p = 160, profiles()
    model = PhaseModel(summarize(workload, p), p, MAX_BATCH)
    optimum = min(model.estimate(a).total for a in allocations(n, (0, 0, 0)))
    t0 = time.perf_counter()
    d = Planner(n).plan(0.0, dict.fromkeys(range(n)), {}, set(), workload, p, MAX_BATCH)
    assert time.perf_counter() - t0 < 0.5  # an exhaustive search is ~13k estimates per plan
    assert d.after.total <= optimum * 1.02 + 1e-9
