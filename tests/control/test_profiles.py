"""What the planner knows: response lengths, throughput per role, shift costs."""

from __future__ import annotations

import math

import pytest

from pivotrl.control.messages import Role
from pivotrl.control.profiles import LengthModel, RoleProfile, ShiftCosts, TrainProfile

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN


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


def line(base: float, per_seq: float, batch: int, tokens: int = 100) -> tuple[int, float, int]:
    """The slice (tokens, seconds, batch) of a device whose decode step takes base + per_seq * batch."""
    return tokens, tokens / batch * (base + per_seq * batch), batch


def test_role_profile_rate_follows_its_step_line():
    p = RoleProfile(step_base=0.04, step_per_seq=0.01)
    assert p.rate(0) == 0.0
    assert p.rate(1) == pytest.approx(20.0)  # 1 token per 0.05 s step
    assert p.rate(6) == pytest.approx(60.0)  # 6 tokens per 0.1 s step
    assert p.rate(1e9) == pytest.approx(100.0, rel=1e-6)  # towards 1 / step_per_seq, never beyond
    assert all(p.rate(b) < p.rate(b + 1) for b in range(1, 64))  # every sequence batched adds throughput


def test_role_profile_from_rates():
    p = RoleProfile.from_rates(seq_rate=20, device_rate=100)
    assert (p.step_base, p.step_per_seq) == pytest.approx((0.04, 0.01))


def test_role_profile_learns_the_line_from_slices_at_several_batches():
    p = RoleProfile(step_base=1.0, step_per_seq=0.5)  # a prior far off
    for i in range(200):
        p.observe(*line(0.008, 0.0001, batch=(1, 16, 64, 128)[i % 4]))
    assert (p.step_base, p.step_per_seq) == pytest.approx((0.008, 0.0001), rel=0.01)


def test_role_profile_at_one_batch_goes_through_the_measured_step():
    # every slice at batch 32: the line goes through the measured step there; the prior still tilts it
    p = RoleProfile(step_base=0.04, step_per_seq=0.01)
    for _ in range(200):
        p.observe(*line(0.02, 0.005, batch=32))
    assert p.step_seconds(32) == pytest.approx(0.02 + 0.005 * 32, rel=0.01)
    assert p.step_base > 0 and p.step_per_seq > 0


def test_role_profile_forgets_old_slices():
    p = RoleProfile(step_base=0.04, step_per_seq=0.01)
    for i in range(100):
        p.observe(*line(0.04, 0.01, batch=(1, 32)[i % 2]))
    for i in range(800):  # contexts grew: each sequence now costs twice as much
        p.observe(*line(0.04, 0.02, batch=(1, 32)[i % 2]))
    assert p.step_per_seq == pytest.approx(0.02, rel=0.02)
    assert p.samples == 900


def test_role_profile_line_stays_positive_on_odd_data():
    p = RoleProfile(step_base=0.04, step_per_seq=0.01)
    for i in range(50):  # bigger batches faster per step (noise): no negative slope
        p.observe(*line(0.2, -0.001, batch=(1, 100)[i % 2]))
    assert p.step_per_seq >= 0 and p.step_base > 0
    for i in range(50):  # steps costing nothing of their own: no negative base
        p.observe(*line(0.0, 0.01, batch=(2, 100)[i % 2]))
    assert p.step_base > 0 and p.rate(1) > 0


def plane(base: float, per_seq: float, per_kv: float, batch: int, context: float) -> tuple[int, float, int, float]:
    """The slice (tokens, seconds, batch, context) of a device whose decode step of ``batch`` sequences
    of ``context`` tokens takes base + per_seq * batch + per_kv * batch * context."""
    tokens = 64 * batch
    return tokens, 64 * (base + per_seq * batch + per_kv * batch * context), batch, context


def test_role_profile_learns_what_the_context_adds_to_a_step():
    # a GPU-like step: 8 ms of weights, 20 us a sequence, 40 ns a token of KV cache read
    truth = (0.008, 2e-5, 4e-8)
    p = RoleProfile(step_base=0.01, step_per_seq=1e-4)  # a prior with no context term
    for i in range(400):
        p.observe(*plane(*truth, batch=(1, 8, 64, 256)[i % 4], context=(600, 2000, 8000)[i % 3]))
    assert (p.step_base, p.step_per_seq, p.step_per_kv) == pytest.approx(truth, rel=0.01)
    # the same batch is 3x dearer deep in the tail than at a step's start
    assert p.step_seconds(128, 8000) / p.step_seconds(128, 600) == pytest.approx(
        (0.008 + 128 * (2e-5 + 4e-8 * 8000)) / (0.008 + 128 * (2e-5 + 4e-8 * 600)), rel=0.01
    )
    # a caller naming no context gets the slices' mean one
    assert p.context == pytest.approx(3533, rel=0.05)
    assert p.step_seconds(64) == pytest.approx(p.step_seconds(64, p.context))


def test_role_profile_of_slices_at_one_context_keeps_the_prior_tilt():
    # every slice at one context says nothing about what a longer one costs: the prior's term stays
    p = RoleProfile(step_base=0.01, step_per_seq=1e-4, step_per_kv=1e-8, context=1000)
    for i in range(300):
        p.observe(*plane(0.008, 2e-5, 0.0, batch=(1, 16, 128)[i % 3], context=1000))
    assert p.step_seconds(16, 1000) == pytest.approx(0.008 + 2e-5 * 16, rel=0.02)
    assert p.step_per_kv == pytest.approx(1e-8, rel=0.5)


def test_role_profile_without_contexts_fits_its_line_as_before():
    # a runtime that counts no KV reads: every slice at the profile's context, the line in the batch
    p = RoleProfile(step_base=1.0, step_per_seq=0.5)
    for i in range(200):
        p.observe(*line(0.008, 0.0001, batch=(1, 16, 64, 128)[i % 4]))
    assert p.context == 0.0 and p.step_per_kv == 0.0
    assert p.step_seconds(64) == pytest.approx(0.008 + 0.0001 * 64, rel=0.01)


@pytest.mark.parametrize("context", [-1.0, float("nan"), float("inf")])
def test_role_profile_rejects_a_bad_context(context):
    with pytest.raises(ValueError, match="context"):
        RoleProfile(step_base=0.04, step_per_seq=0.01).observe(10, 1.0, 2, context)


def test_role_profile_skips_slices_without_tokens():
    p = RoleProfile(step_base=0.04, step_per_seq=0.01)
    p.observe(0, 1.0, 4)
    assert (p.step_base, p.step_per_seq, p.samples) == (0.04, 0.01, 0)


@pytest.mark.parametrize("slice_", [pytest.param((10, 0.0, 1), id="seconds"), pytest.param((10, 1.0, 0), id="batch")])
def test_role_profile_rejects_bad_measurements(slice_):
    with pytest.raises(ValueError):
        RoleProfile(step_base=0.04, step_per_seq=0.01).observe(*slice_)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step_base": 0.0, "step_per_seq": 0.01},
        {"step_base": 0.04, "step_per_seq": -1.0},
        {"step_base": 0.04, "step_per_seq": 0.01, "decay": 0.0},
        {"step_base": 0.04, "step_per_seq": 0.01, "ref_batch": 1.0},
        {"step_base": 0.04, "step_per_seq": 0.01, "step_per_kv": -1e-9},
        {"step_base": 0.04, "step_per_seq": 0.01, "context": -5.0},
    ],
)
def test_role_profile_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        RoleProfile(**kwargs)


def test_role_profile_from_rates_rejects_a_device_slower_than_a_sequence():
    with pytest.raises(ValueError, match="device_rate"):
        RoleProfile.from_rates(seq_rate=100, device_rate=50)


def test_train_profile_is_an_ewma_of_tokens_per_second():
    p = TrainProfile(device_rate=1000, alpha=0.5)
    p.observe(0, 1.0)  # nothing trained: skipped
    assert (p.device_rate, p.samples) == (1000, 0)
    for _ in range(20):
        p.observe(3000, 2.0)
    assert p.device_rate == pytest.approx(1500, abs=1e-3) and p.samples == 20
    with pytest.raises(ValueError):
        p.observe(10, 0.0)


# -- ShiftCosts -----------------------------------------------------------------------------------


def test_shift_costs_are_measured_means_with_a_prior():
    c = ShiftCosts(prior=0.05)
    c.observe(R, G, 0.2)
    c.observe(R, G, 0.4)
    c.observe(None, T, 1.0)
    assert c.cost(R, G) == pytest.approx(0.3)
    assert c.cost(G, R) == 0.05  # never measured: the prior
    assert c.cost(None, T) == 1.0
    assert c.cost(T, T) == 0.0


def test_role_profile_learns_its_prefill_rate():
    p = RoleProfile(step_base=0.04, step_per_seq=0.01, prefill_rate=1000)
    p.observe_prefill(30_000, 1.0, alpha=0.5)  # a timed prefill pulls the rate (EWMA) ...
    assert p.prefill_rate == pytest.approx(15_500)
    p.observe_prefill(0, 0.0)  # ... and a slice without one says nothing
    assert p.prefill_rate == pytest.approx(15_500)


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


def test_length_model_says_when_a_running_sequence_has_ended():
    lm = lengths(10, 20, 30, 40)
    assert lm.done_by(15, [0, 5, 10, 25, 100]) == pytest.approx([0.0, 1 / 3, 1 / 3, 1.0, 1.0])  # of 20, 30, 40
    assert lm.done_by(40, [1.0]) == [1.0]  # past every length seen: it ends at once
    prior = lengths(prior_mean=100, prior_max=300)  # nothing seen: memoryless, and the limit ends it
    assert prior.done_by(0, [100, 300]) == pytest.approx([1 - math.exp(-1), 1.0])


def test_role_profile_follows_a_curve_a_line_cannot():
    # a mixture-of-experts step: steep over the first sequences (more experts read), flat beyond
    def step(b: int) -> float:
        return 0.005 + 0.0005 * math.sqrt(b)

    p = RoleProfile(step_base=0.01, step_per_seq=1e-4)
    batches = (1, 4, 16, 64, 256)
    for i in range(500):
        b = batches[i % len(batches)]
        p.observe(100 * b, 100 * step(b), b)
    for b in batches:  # measured batches: the curve through them, where the line misses by up to 40%
        assert p.step_seconds(b) == pytest.approx(step(b), rel=0.01)
    assert max(abs(p.line(b) / step(b) - 1) for b in batches) > 0.1
    assert p.step_seconds(8) == pytest.approx(step(8), rel=0.05)  # between bins: interpolated
    assert p.rate(256) > p.rate(64) > p.rate(1)


def test_role_profile_remembers_small_batches_while_large_ones_are_measured():
    p = RoleProfile(step_base=0.01, step_per_seq=1e-4)
    for _ in range(20):
        p.observe(100, 100 * 0.004, 1)  # a tail: alone, 4 ms a step
    for _ in range(2000):
        p.observe(100 * 128, 100 * 0.02, 128)  # the next step's bulk
    assert p.step_seconds(1) == pytest.approx(0.004, rel=0.02)


def test_learned_profiles_survive_a_checkpoint_as_json():
    """What the planner learned, written as JSON and read back into fresh profiles, answers the same."""
    import json

    from pivotrl.control.messages import Role
    from pivotrl.control.shiftable import Shiftable

    learned, fresh = Shiftable(4, 64, 96, 64, 256), Shiftable(4, 64, 96, 64, 256)
    p = learned.profiles
    for b, c, s in ((4, 100, 0.02), (16, 300, 0.05), (64, 900, 0.2), (32, 500, 0.09)):
        p.rollout.observe(b * 10, s * 10, b, c)
        p.judge.observe(b * 5, s * 4, b, c)
    p.rollout.observe_prefill(4000, 0.5)
    p.train.observe(20_000, 2.0)
    for n in (12, 40, 96, 7, 55) * 10:
        p.lengths.observe(n)
        p.judgments.observe(n // 2)
    p.costs.observe(Role.ROLLOUT, Role.JUDGE, 0.3)
    p.costs.observe(None, Role.TRAIN, 0.9)
    state = json.loads(json.dumps(learned.state()))
    fresh.restore(state)
    q = fresh.profiles
    for b, c in ((1, 50), (8, 400), (128, 2000)):
        assert q.rollout.rate(b, c) == p.rollout.rate(b, c) and q.judge.rate(b, c) == p.judge.rate(b, c)
    assert q.train.device_rate == p.train.device_rate
    assert [q.lengths.expected_remaining(t) for t in (0, 30, 90)] == [
        p.lengths.expected_remaining(t) for t in (0, 30, 90)
    ]
    assert q.judgments.expected_longest({0: 8}) == p.judgments.expected_longest({0: 8}) != 24.0
    assert q.costs.cost(Role.ROLLOUT, Role.JUDGE) == p.costs.cost(Role.ROLLOUT, Role.JUDGE)
    assert q.costs.cost(None, Role.TRAIN) == p.costs.cost(None, Role.TRAIN)
    assert json.loads(json.dumps(fresh.state())) == json.loads(json.dumps(learned.state()))  # caches alike too


def test_a_checkpoint_from_before_judgment_lengths_were_learned_still_restores():
    """A checkpoint written before the planner learned judgment lengths restores; they start from the prior."""
    import json

    from pivotrl.control.shiftable import Shiftable

    older = json.loads(json.dumps(Shiftable(4, 64, 96, 64, 256).state()))
    del older["judgments"]
    fresh = Shiftable(4, 64, 96, 64, 256)
    fresh.restore(older)
    assert fresh.profiles.judgments.samples == 0 and fresh.profiles.judgments.prior_max == 64.0
