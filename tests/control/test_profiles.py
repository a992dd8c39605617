"""What the planner knows: response lengths, throughput per role, shift costs."""

from __future__ import annotations

import pytest

from pivotrl.control.messages import Role
from pivotrl.control.profiles import LengthModel, RoleProfile, ShiftCosts

R, G, T = Role.ROLLOUT, Role.GENRM, Role.TRAIN


# -- LengthModel ------------------------------------------------------------------------------


def lengths(*observed: int, min_samples: int = 4, window: int = 4096, **prior: float) -> LengthModel:
    lm = LengthModel(min_samples=min_samples, window=window, **prior)
    for n in observed:
        lm.observe(n)
    return lm


EXPECTED_REMAINING = [
    # lengths seen: 10, 20, 30, 40
    pytest.param(0, 25.0, id="nothing-yet:the-mean"),
    pytest.param(10, 20.0, id="past-10:(20+30+40)/3-10"),
    pytest.param(15, 15.0, id="between:(20+30+40)/3-15"),
    pytest.param(35, 5.0, id="only-the-longest-left:40-35"),
    pytest.param(40, 1.0, id="at-the-longest:floor"),
    pytest.param(500, 1.0, id="past-every-length:floor"),
]


@pytest.mark.parametrize(("t", "expected"), EXPECTED_REMAINING)
def test_expected_remaining_is_the_mean_excess_of_the_lengths_seen(t, expected):
    assert lengths(10, 20, 30, 40).expected_remaining(t) == pytest.approx(expected)


PRIOR = [
    pytest.param(0, 100.0, 300.0, id="fresh:prior-mean"),
    pytest.param(150, 100.0, 150.0, id="memoryless:still-prior-mean"),
    pytest.param(250, 50.0, 50.0, id="near-the-limit:what-the-limit-leaves"),
    pytest.param(400, 1.0, 1.0, id="past-the-limit:floor"),
]


@pytest.mark.parametrize(("t", "expected", "most"), PRIOR)
def test_too_few_lengths_fall_back_to_the_prior(t, expected, most):
    lm = lengths(10, 20, 30, prior_mean=100.0, prior_max=300.0)  # 3 < min_samples
    assert lm.expected_remaining(t) == pytest.approx(expected)
    assert lm.max_remaining(t) == pytest.approx(most)
    assert lm.mean == 100.0


def test_max_remaining_runs_to_the_longest_length_seen():
    lm = lengths(10, 20, 30, 40)
    assert [lm.max_remaining(t) for t in (0, 15, 40, 90)] == [40.0, 25.0, 1.0, 1.0]
    assert lm.mean == 25.0


def test_length_window_keeps_the_most_recent():
    lm = lengths(1000, 10, 20, 30, 40, window=4)  # 1000 falls out
    assert lm.samples == 4
    assert lm.expected_remaining(0) == pytest.approx(25.0)
    assert lm.max_remaining(0) == 40.0


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"prior_mean": 0}, id="prior_mean"),
        pytest.param({"floor": -1}, id="floor"),
        pytest.param({"min_samples": 8, "window": 4}, id="window-below-min_samples"),
    ],
)
def test_length_model_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LengthModel(**kwargs)


# -- RoleProfile --------------------------------------------------------------------------------

OBSERVE = [
    # device_rate=100, seq_rate=10, alpha=0.5; one slice (tokens, seconds, batch) -> (device_rate, seq_rate)
    pytest.param((60, 1.0, 4), (100.0, 12.5), id="unsaturated:learns-seq-rate"),
    pytest.param((80, 1.0, 16), (90.0, 10.0), id="saturated:learns-device-rate"),
    pytest.param((300, 1.0, 16), (200.0, 14.375), id="saturated-but-faster-seqs:both"),
    pytest.param((130, 1.0, 2), (115.0, 37.5), id="unsaturated-but-above-device-rate:both"),
    pytest.param((0, 1.0, 4), (100.0, 10.0), id="no-tokens:skipped"),
]


@pytest.mark.parametrize(("slice_", "after"), OBSERVE)
def test_role_profile_updates_the_term_that_binds(slice_, after):
    p = RoleProfile(device_rate=100, seq_rate=10, alpha=0.5)
    p.observe(*slice_)
    assert (p.device_rate, p.seq_rate) == pytest.approx(after)


def test_role_profile_is_an_ewma():
    p = RoleProfile(device_rate=100, seq_rate=10, alpha=0.5)
    for _ in range(20):
        p.observe(8, 1.0, 1)  # a sequence alone goes at 8 tok/s
    assert p.seq_rate == pytest.approx(8.0, abs=1e-4)
    assert p.samples == 20


@pytest.mark.parametrize(("batch", "rate"), [(0, 0.0), (0.5, 5.0), (4, 40.0), (10, 100.0), (64, 100.0)])
def test_role_profile_rate_is_a_roofline(batch, rate):
    assert RoleProfile(device_rate=100, seq_rate=10).rate(batch) == rate


@pytest.mark.parametrize("slice_", [pytest.param((10, 0.0, 1), id="seconds"), pytest.param((10, 1.0, 0), id="batch")])
def test_role_profile_rejects_bad_measurements(slice_):
    with pytest.raises(ValueError):
        RoleProfile(device_rate=100, seq_rate=10).observe(*slice_)


# -- ShiftCosts -----------------------------------------------------------------------------------


def test_shift_costs_are_measured_means_with_a_prior():
    c = ShiftCosts(prior=0.05, prefill_rate=1000)
    c.observe(R, G, 0.2)
    c.observe(R, G, 0.4)
    c.observe(None, T, 1.0)
    assert c.cost(R, G) == pytest.approx(0.3)
    assert c.cost(G, R) == 0.05  # never measured: the prior
    assert c.cost(None, T) == 1.0
    assert c.cost(T, T) == 0.0
    assert c.migration_cost(2500) == pytest.approx(2.5)
    c.observe_prefill(30_000, 1.0, alpha=0.5)  # measured prefill speed pulls the rate (EWMA) ...
    assert c.prefill_rate == pytest.approx(15_500) and c.migration_cost(2500) == pytest.approx(2500 / 15_500)
    c.observe_prefill(0, 0.0)  # ... and an empty slice says nothing
    assert c.prefill_rate == pytest.approx(15_500)


def test_expected_longest_is_the_expected_maximum_not_the_largest_expectation():
    lm = lengths(*range(1, 101))  # lengths 1..100, once each
    # three sequences at 50 tokens: each has 1..50 left, uniformly; the last one to end needs
    # E[max of 3] = sum over x of 1 - (x/50)^3 = 38.0 tokens, not the 25.5 each expects
    assert lm.expected_remaining(50) == pytest.approx(25.5)
    assert lm.expected_longest({50: 3}) == pytest.approx(38.0, rel=0.03)
    assert lm.expected_longest({50: 1}) == pytest.approx(25.5, rel=0.03)
    assert lm.expected_longest({50: 30}) > lm.expected_longest({50: 3}) > lm.expected_longest({90: 3})
    assert lm.expected_longest({}) == 0.0 and lm.expected_longest({100: 2}) == lm.floor  # outlived every length
    assert lengths().expected_longest({0: 5}) == lengths().expected_remaining(0)  # before data: the prior's rest
