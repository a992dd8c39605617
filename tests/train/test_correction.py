"""Off-policy correction of the policy-gradient loss (``train.correction``), against losses and gradients worked
out by hand: the importance weight of a token is the trainer's probability of it over the engine's that sampled
it, ``w = pi_prox / pi_behaviour``; the PPO ratio is taken against the trainer's own log-probs (ratio 1 at the
forward, so its gradient is the plain policy gradient, ``-A * grad log p``), times the weight."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from pivotrl.train.config import TrainConfig
from pivotrl.train.group import TrainGroup
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.loss import correction_weights, grpo_loss_sum, host_stats
from pivotrl.train.zero import ZeroTrainer
from tests.train.test_grpo import random_batch, response_logprobs, tiny_model


def terms(prox: list[list[float]], behaviour: list[list[float]], adv: list[float], mask=None, **kw):
    """The loss, its stats and the gradient over log-probs ``prox`` (probabilities), the engine's ``behaviour``."""
    logp = torch.tensor(prox).log().requires_grad_()
    old = torch.tensor(behaviour).log()
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, stats = grpo_loss_sum(logp, old, torch.tensor(adv), mask, 0.2, 0.2, **kw)
    loss.backward()
    return float(loss.detach()), host_stats(stats), logp.grad.tolist()


def test_tis_truncates_each_token_weight_at_the_cap():
    # w = [0.5/0.25, 0.55/0.5] = [2.0, 1.1]; the first truncated at 1.5
    loss, stats, grad = terms([[0.5, 0.55]], [[0.25, 0.5]], [1.0], correction="tis", cap=1.5)
    assert loss == pytest.approx(-(1.5 + 1.1))
    assert grad[0] == pytest.approx([-1.5, -1.1])
    assert stats["is_weight_sum"] == pytest.approx(3.1)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_capped_tokens"] == 1


def test_none_clips_the_ratio_against_the_engine_instead():
    """Today's loss, for contrast: the ratio against the engine's log-probs, 2.0 clipped at 1.2 (no gradient),
    1.1 kept; no weights reported."""
    loss, stats, grad = terms([[0.5, 0.55]], [[0.25, 0.5]], [1.0])
    assert loss == pytest.approx(-(1.2 + 1.1))
    assert grad[0] == pytest.approx([0.0, -1.1])
    assert "is_weight_sum" not in stats


def test_mis_masks_whole_sequences_whose_weight_exceeds_the_cap():
    # row 0: w = [2.0, 1.1], the sequence's 2.2 > 2: nothing; row 1: w = [1.25, 0.8], the sequence's 1.0: kept,
    # each token weighted by 1.0 (A = -1: +1 a token)
    loss, stats, grad = terms(
        [[0.5, 0.55], [0.5, 0.4]], [[0.25, 0.5], [0.4, 0.5]], [1.0, -1.0], correction="mis", cap=2.0
    )
    assert loss == pytest.approx(2.0)
    assert grad[0] == pytest.approx([0.0, 0.0])
    assert grad[1] == pytest.approx([1.0, 1.0])
    assert stats["is_capped_tokens"] == 2
    assert stats["is_weight_sum"] == pytest.approx(2.0 + 1.1 + 1.25 + 0.8)
    # a kept sequence is weighted by its own product, not by 1
    loss, _, grad = terms([[0.5, 0.55]], [[0.25, 0.5]], [1.0], correction="mis", cap=3.0)
    assert loss == pytest.approx(-2 * 2.2) and grad[0] == pytest.approx([-2.2, -2.2])


def test_decoupled_masks_tokens_whose_weight_exceeds_the_cap():
    # w = [2.0, 1.1]: the first masked (weight 0), the second kept whole
    loss, stats, grad = terms([[0.5, 0.55]], [[0.25, 0.5]], [-2.0], correction="decoupled", cap=1.5)
    assert loss == pytest.approx(2.0 * 1.1)
    assert grad[0] == pytest.approx([0.0, 2.2])
    assert stats["is_capped_tokens"] == 1


@pytest.mark.parametrize("correction", ["tis", "mis", "decoupled"])
def test_padding_with_extreme_log_probs_weighs_nothing(correction):
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1000.0]])  # the padded slot's difference would overflow exp
    mask = torch.tensor([[True, False]])
    weights, _ = correction_weights(logp.detach(), old, mask, correction, 2.0)
    assert weights.tolist() == [[1.0, 0.0]]
    loss, stats = grpo_loss_sum(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2, correction=correction)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0) and torch.isfinite(logp.grad).all()
    assert host_stats(stats)["is_weight_max"] == pytest.approx(1.0)


def test_a_weight_past_fp32_is_reported_finite():
    _, stats, _ = terms([[1.0]], [[math.exp(-500.0)]], [1.0], correction="tis")  # (the engine's 0 in fp32)
    assert math.isfinite(stats["is_weight_max"]) and stats["is_weight_max"] > 1e30


@pytest.mark.parametrize("correction", ["tis", "mis", "decoupled"])
def test_on_policy_samples_get_the_update_of_no_correction(correction):
    """Samples whose recorded log-probs are the trainer's own: every weight is 1, the update is the plain one."""
    base = tiny_model()
    samples, adv = on_policy(base, random_batch(base, groups=3, rng=random.Random(0)))
    plain, corrected = copy.deepcopy(base), copy.deepcopy(base)
    a = GRPOTrainer(plain, TrainConfig(lr=1e-3)).train_batch(samples, adv)
    b = GRPOTrainer(corrected, TrainConfig(lr=1e-3, correction=correction)).train_batch(samples, adv)
    assert b["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and b["is_capped_frac"] == 0.0
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for p, q in zip(plain.parameters(), corrected.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def on_policy(model, batch):
    """The batch with every recorded log-prob the model's own (as an engine holding these weights records)."""
    samples, adv = batch
    for s in samples:
        s.logprobs = response_logprobs(model, s.prompt_ids, s.response_ids)
    return samples, adv


def stale(samples, shift: float):
    """The samples as an older policy would have sampled them: every recorded log-prob moved by ``shift`` per token
    in turn (+, -, +, ...), so some weights pass the cap."""
    for s in samples:
        s.logprobs = [lp + (shift if i % 2 else -shift) for i, lp in enumerate(s.logprobs)]
    return samples


def test_a_trainer_of_one_rank_reports_what_the_plain_trainer_does():
    """The stats of a trainer that gathers its group's (ZeRO-1 here) are the plain trainer's: sums, the maximum."""
    base = tiny_model()
    samples, adv = on_policy(base, random_batch(base, groups=3, rng=random.Random(1)))
    samples = stale(samples, 1.0)
    cfg = TrainConfig(lr=1e-3, correction="tis", correction_cap=2.0)
    want = GRPOTrainer(copy.deepcopy(base), cfg).train_batch(samples, adv)
    assert 0 < want["is_capped_frac"] < 1 and want["is_weight_max"] == pytest.approx(math.e, rel=1e-4)
    zero = ZeroTrainer(copy.deepcopy(base), cfg, 1.0, 0)
    with TrainGroup.join(0, 1, device="cpu", process_group=True) as group:
        zero.accumulate(samples, adv)
        zero.bind(group)
        zero.load_weights(None)
        got = zero.step(sum(len(s.response_ids) for s in samples)).stats
    for key in ("is_weight_mean", "is_weight_max", "is_capped_frac", "grad_norm", "loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("correction", "is", "one of none, tis, mis, decoupled"), ("correction_cap", 1.0, "> 1")],
)
def test_config_rejects_bad_corrections(field, value, allowed):
    with pytest.raises(ValueError, match=rf"train\.{field} must be {allowed}.*, got {value!r}"):
        TrainConfig(**{field: value})
