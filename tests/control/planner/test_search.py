"""The search over allocations: which splits a plan weighs, and how close it comes to the best."""

from __future__ import annotations

import pytest

from pivotrl.control.planner import PhaseModel, Planner, initial_split, summarize
from pivotrl.control.planner.search import (
    EXHAUSTIVE_UP_TO,
    Scene,
    allocations,
    candidate,
    candidate_allocations,
    flows,
    late_arrivals,
    moves,
    pick,
    search,
    take,
)
from pivotrl.control.profiles import ShiftCosts
from tests.control.planner.cases import EARLY, JUDGE_BURST, MAX_BATCH, REWARDS_IN, TAIL, G, R, T, profiles

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


def test_every_split_above_the_floor_is_an_allocation():
    every = list(allocations(4, (0, 0, 0)))
    assert len(every) == 15 and len(set(every)) == 15 and all(sum(a) == 4 for a in every)
    assert set(allocations(4, (1, 0, 2))) == {(1, 0, 3), (1, 1, 2), (2, 0, 2)}
    assert list(allocations(2, (1, 1, 1))) == []  # a floor above the devices: none


def test_a_clusters_allocations_are_a_coarse_grid_refined_around_its_best_and_the_current():
    n = 120
    assert candidate_allocations(EXHAUSTIVE_UP_TO, (0, 0, 0), (32, 0, 0), sum) == list(allocations(32, (0, 0, 0)))
    best = (60, 30, 30)
    distance = lambda a: abs(a[0] - best[0]) + abs(a[1] - best[1])  # noqa: E731
    cands = candidate_allocations(n, (0, 0, 0), (7, 100, 13), distance)
    assert len(cands) < 250 and all(sum(a) == n for a in cands)
    assert best in cands and (61, 29, 30) in cands  # around the grid's best, device by device
    assert (8, 100, 12) in cands and (6, 101, 13) in cands  # one device around the current one
    assert all(a[2] >= 5 for a in candidate_allocations(n, (0, 0, 5), (60, 55, 5), distance))  # pinned stay


def test_unassigned_devices_fill_the_roles_short_of_devices_first():
    assert flows((2, 1, 0), 1, (2, 1, 1)) == {(None, T): 1}
    assert flows((3, 1, 0), 1, (1, 2, 2)) == {(None, G): 1, (R, T): 2}
    assert flows((2, 1, 1), 0, (2, 1, 1)) == {}


def test_the_devices_a_move_brings_in_arrive_after_the_slowest_shift():
    costs = ShiftCosts(prior=1.0)
    costs.observe(R, T, 3.0)
    late = late_arrivals({(None, T): 1, (R, T): 2, (R, G): 1}, costs)
    assert late == ((0, 0.0), (1, costs.cost(R, G)), (3, max(costs.cost(None, T), costs.cost(R, T))))


def test_the_cheapest_devices_fill_the_slots_never_one_back_to_the_role_it_left():
    barred = {1: T, 2: None}.get
    # devices 0..3 least loaded first; 1 just left train: it may go to the judge only
    assert sorted(take([0, 1, 2, 3], {T: 1, G: 1}, barred)) == [(0, T), (1, G)]
    assert take([1, 0], {T: 1}, barred) == [(0, T)]
    assert take([1], {T: 1}, barred) is None  # none that may go


def scene(current: dict, busy: dict, barred: dict | None = None) -> Scene:
    orders = {role: sorted((d for d, r in current.items() if r is role), key=lambda d: (busy.get(d, 0), d))
              for role in (R, G, T)}  # fmt: skip
    unassigned = sorted(d for d, r in current.items() if r is None)
    return Scene(unassigned, busy, orders, barred or {}, {R: 0.5, G: 0.0, T: 0.0})


def test_a_candidate_moves_the_least_loaded_devices_and_pays_their_migrations():
    p = profiles()
    model = PhaseModel(summarize(TAIL, p), p, MAX_BATCH)
    c = candidate((1, 3, 0), (3, 1, 0), 0, {R: 3, G: 1, T: 0}, model)
    assert c is not None and c.moves_a_role and c.moved == 2 and c.bound == c.est.total
    assert candidate((1, 3, 0), (3, 1, 0), 0, {R: 1, G: 1, T: 0}, model) is None  # only one may leave the rollout
    where = scene({0: R, 1: R, 2: R, 3: G}, busy={0: 4, 1: 1, 2: 2})
    assert pick(c, where)
    assert moves(c, where) == [(1, R, G), (2, R, G)]  # the two least busy
    # the 3 requests they hold re-prefill on the one rollout device that stays, 0.5 s each
    assert c.overhead == pytest.approx(1.5) and c.total == pytest.approx(c.est.total + 1.5)


def test_a_device_barred_from_its_destination_is_not_picked():
    p = profiles()
    model = PhaseModel(summarize(TAIL, p), p, MAX_BATCH)
    c = candidate((2, 2, 0), (3, 1, 0), 0, {R: 3, G: 1, T: 0}, model)
    where = scene({0: R, 1: R, 2: R, 3: G}, busy={0: 4, 1: 1, 2: 2}, barred={1: G, 2: G, 0: G})
    assert not pick(c, where)
    where = scene({0: R, 1: R, 2: R, 3: G}, busy={0: 4, 1: 1, 2: 2}, barred={1: G})
    assert pick(c, where) and moves(c, where) == [(2, R, G)]


def test_the_search_finds_the_best_and_the_best_that_keeps_every_role():
    p = profiles()
    model = PhaseModel(summarize(TAIL, p), p, MAX_BATCH)
    current = (4, 0, 0)
    cands = [c for a in allocations(4, (0, 0, 0)) if (c := candidate(a, current, 0, {R: 4, G: 0, T: 0}, model))]
    cands.sort(key=lambda c: (c.bound, c.moved, c.alloc))
    best, stay = search(cands, scene({0: R, 1: R, 2: R, 3: R}, busy={}))
    assert stay.alloc == current and not stay.moves_a_role
    assert best.total <= stay.total and best.total == min(c.total for c in cands if c.picked)
