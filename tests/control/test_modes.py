"""Allocation policies: which role each device should hold, case by case."""

from __future__ import annotations

import pytest

from pivotrl.control.messages import Role
from pivotrl.control.modes import Colocated, Demand, Disaggregated, default_split, make_policy

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN


def demand(gen: int = 0, judge: int = 0, train_ready: bool = False, training: bool = False) -> Demand:
    return Demand(gen, judge, train_ready, training)


# -- colocated ------------------------------------------------------------------------

COLOCATED = [
    pytest.param(demand(gen=5), R, id="gen-pending"),
    pytest.param(demand(gen=1, judge=7), R, id="gen-and-judge-pending:rollout-first"),
    pytest.param(demand(judge=3), G, id="only-judge-pending"),
    pytest.param(demand(judge=2, train_ready=True), G, id="judge-before-train"),
    pytest.param(demand(train_ready=True), T, id="train-ready"),
    pytest.param(demand(training=True), T, id="training"),
    pytest.param(demand(gen=4, training=True), R, id="next-step-gen-while-training"),
    pytest.param(demand(), R, id="nothing:rollout"),
]


@pytest.mark.parametrize("devices", [1, 3], ids=lambda n: f"{n}dev")
@pytest.mark.parametrize(("snapshot", "role"), COLOCATED)
def test_colocated_moves_every_device_to_the_phase_with_work(devices, snapshot, role):
    policy = Colocated(devices)
    assert policy.targets(snapshot) == dict.fromkeys(range(devices), role)
    assert policy.train_devices() == tuple(range(devices))


# -- disaggregated ----------------------------------------------------------------------

SPLITS = [
    pytest.param(3, {R: 1, G: 1, T: 1}, [R, G, T], id="3:1-1-1"),
    pytest.param(4, {R: 2, G: 1, T: 1}, [R, R, G, T], id="4:2-1-1"),
    pytest.param(5, {R: 1, G: 2, T: 2}, [R, G, G, T, T], id="5:1-2-2"),
    pytest.param(6, {T: 1, G: 2, R: 3}, [R, R, R, G, G, T], id="6:3-2-1:key-order-ignored"),
]


@pytest.mark.parametrize(("devices", "split", "roles"), SPLITS)
def test_disaggregated_lays_out_rollout_then_judge_then_train(devices, split, roles):
    policy = Disaggregated(devices, split)
    expected = dict(enumerate(roles))
    for snapshot in (demand(gen=3), demand(judge=3), demand(train_ready=True), demand(training=True), demand()):
        assert policy.targets(snapshot) == expected  # static: demand does not move anyone
    assert policy.train_devices() == tuple(d for d, r in expected.items() if r is T)


DEFAULT_SPLITS = [
    pytest.param(3, (1, 1, 1), id="3"),
    pytest.param(4, (2, 1, 1), id="4"),
    pytest.param(5, (3, 1, 1), id="5"),
    pytest.param(6, (3, 2, 1), id="6"),
    pytest.param(7, (4, 2, 1), id="7"),
    pytest.param(8, (5, 2, 1), id="8"),
]


def test_default_split_trains_on_the_fewest_devices_the_step_needs():
    assert default_split(8, train=3) == {R: 3, G: 2, T: 3}
    assert make_policy("disaggregated", 8, min_train=3).train_devices() == (5, 6, 7)


@pytest.mark.parametrize(("devices", "counts"), DEFAULT_SPLITS)
def test_default_split(devices, counts):
    split = default_split(devices)
    assert (split[R], split[G], split[T]) == counts
    assert all(n >= 1 for n in split.values()) and sum(split.values()) == devices
    policy = Disaggregated(devices)
    roles = [policy.targets(demand())[d] for d in range(devices)]
    assert roles == [R] * counts[0] + [G] * counts[1] + [T] * counts[2]
    assert policy.train_devices() == tuple(range(devices - counts[2], devices))


# -- errors -----------------------------------------------------------------------------

ERRORS = [
    pytest.param(
        lambda: Disaggregated(4, {R: 2, G: 1, T: 2}), r"split: .* uses 5 devices, but devices=4", id="sum>devices"
    ),
    pytest.param(lambda: Disaggregated(5, {R: 2, G: 1, T: 1}), r"uses 4 devices, but devices=5", id="sum<devices"),
    pytest.param(lambda: Disaggregated(4, {R: 3, G: 0, T: 1}), r"at least one device for judge", id="judge:0"),
    pytest.param(lambda: Disaggregated(4, {R: 3, G: 1}), r"at least one device for train", id="train-missing"),
    pytest.param(lambda: Disaggregated(4, {R: 0, G: 2, T: 2}), r"at least one device for rollout", id="rollout:0"),
    pytest.param(lambda: Disaggregated(2), r"needs at least 3 devices .* got 2", id="2dev-default"),
    pytest.param(lambda: Disaggregated(2, {R: 1, G: 1, T: 0}), r"at least one device for train", id="2dev-split"),
    pytest.param(lambda: default_split(1), r"needs at least 3 devices .* got 1", id="default_split(1)"),
    pytest.param(lambda: Colocated(0), r"at least 1 device, got 0", id="colocated-0dev"),
    pytest.param(lambda: make_policy("pipelined", 4), r"mode: 'pipelined' is not available .*colocated", id="unknown"),
    pytest.param(
        lambda: make_policy("colocated", 3, {"rollout": 1}), r"split: only used with mode=disagg", id="coloc+split"
    ),
    pytest.param(lambda: make_policy("disaggregated", 2), r"needs at least 3 devices", id="make-disagg-2dev"),
    pytest.param(
        lambda: make_policy("disaggregated", 4, {"rollout": 2, "judge": 1, "train": 1}, min_train=2),
        r"split: train:1 is fewer than the 2 devices the optimizer step needs \(train.min_devices\)",
        id="split-below-min-train",
    ),
    pytest.param(lambda: default_split(4, train=3), r"needs at least 5 devices \(3 to train", id="default-min-train"),
    pytest.param(
        lambda: make_policy("colocated", 2, min_train=3),
        r"optimizer step needs 3 devices, but the job has 2",
        id="colocated-below-min-train",
    ),
    pytest.param(
        lambda: make_policy("shiftable", 2, min_train=3),
        r"optimizer step needs 3 devices, but the job has 2",
        id="shiftable-below-min-train",
    ),
]


@pytest.mark.parametrize(("build", "message"), ERRORS)
def test_bad_layouts_fail_with_a_clear_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


MAKE = [
    pytest.param("colocated", 2, None, Colocated, {0: R, 1: R}, id="colocated"),
    pytest.param("disaggregated", 4, None, Disaggregated, {0: R, 1: R, 2: G, 3: T}, id="disaggregated-default"),
    pytest.param(
        "disaggregated",
        4,
        {"rollout": 1, "judge": 2, "train": 1},
        Disaggregated,
        {0: R, 1: G, 2: G, 3: T},
        id="disaggregated-split-by-name",
    ),
]


@pytest.mark.parametrize(("mode", "devices", "split", "cls", "roles"), MAKE)
def test_make_policy(mode, devices, split, cls, roles):
    policy = make_policy(mode, devices, split)
    assert isinstance(policy, cls) and policy.name == mode and policy.devices == devices
    assert policy.targets(demand(gen=1)) == roles
