import copy
import math
import random

import pytest
import torch

from pivotrl.model import Decoder
from pivotrl.sample import Sample
from pivotrl.train.advantages import group_advantages
from pivotrl.train.config import TrainConfig
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.loss import grpo_loss_sum as loss_terms
from pivotrl.train.loss import host_stats, token_logprobs
from tests.conftest import tiny_config

G = 4  # group size


def tiny_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab=32)
    return Decoder(cfg).eval()


def response_logprobs(model: Decoder, prompt: list[int], response: list[int]) -> list[float]:
    """The model's own log-prob of each response token (what an on-policy rollout would record)."""
    if not response:
        return []
    with torch.no_grad():
        lp = token_logprobs(model, torch.tensor([prompt + response]))[0]
    return lp[len(prompt) - 1 : len(prompt) + len(response) - 1].tolist()


def make_sample(uid: int, prompt: list[int], response: list[int], logprobs: list[float]) -> Sample:
    return Sample(
        uid=uid,
        prompt_index=uid // G,
        question="",
        reference="",
        prompt_ids=prompt,
        seed=0,
        response_ids=response,
        logprobs=logprobs,
    )


# --- group_advantages ---------------------------------------------------------


def test_group_advantages_one_correct_of_four():
    # mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330
    adv = group_advantages([1, 0, 0, 0], G)
    assert adv == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-5)


def test_group_advantages_groups_are_independent_and_equal_groups_are_zero():
    adv = group_advantages([0.1, 0.1, 0.1, 0.1, 1, 1, 0, 0], G)
    assert adv[:4] == [0.0, 0.0, 0.0, 0.0]
    assert adv[4:] == pytest.approx([1, 1, -1, -1], rel=1e-5)


def test_group_advantages_without_std_scaling():
    assert group_advantages([1, 0, 0, 0, 2, 2, 2, 6], G, scale_by_std=False) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, -1, -1, -1, 3]
    )


@pytest.mark.parametrize(("n", "group_size"), [(5, 4), (3, 2), (4, 0)])
def test_group_advantages_rejects_bad_shapes(n, group_size):
    with pytest.raises(ValueError):
        group_advantages([0.0] * n, group_size)


# --- grpo_loss_sum ---------------------------------------------------------------


def grpo_loss_sum(*args, **kwargs):
    """The loss and its stats read as numbers."""
    loss, stats = loss_terms(*args, **kwargs)
    return loss, host_stats(stats)


def test_loss_on_policy_is_minus_advantage_times_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.float32)
    loss, stats = grpo_loss_sum(logp, logp.clone(), adv, mask, 0.2, 0.2)
    assert float(loss) == pytest.approx(-(2.0 * 2 + -1.0 * 2))
    assert stats["tokens"] == 4
    assert stats["clipped_tokens"] == 0
    assert stats["ratio_max"] == pytest.approx(1.0)


def test_loss_clipping_for_both_advantage_signs():
    # rows: (A=+1, r=1.5) clipped at 1.2; (A=-1, r=0.5) clipped at 0.8;
    #       (A=+1, r=0.5) not clipped (the min keeps r*A); (A=-1, r=1.5) not clipped
    ratio = torch.tensor([[1.5], [0.5], [0.5], [1.5]])
    old = torch.log(torch.tensor([[0.4], [0.4], [0.4], [0.4]]))
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = grpo_loss_sum(logp, old, adv, torch.ones(4, 1), clip_low=0.2, clip_high=0.2)
    # per token: -1.2, +0.8, -0.5, +1.5
    assert float(loss.detach()) == pytest.approx(-1.2 + 0.8 - 0.5 + 1.5)
    assert stats["clipped_tokens"] == 2
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_min"] == pytest.approx(0.5)
    loss.backward()
    # clipped tokens pass no gradient; the others get d(-r*A)/dlogp = -r*A
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5])


def test_loss_asymmetric_clip_range():
    ratio = torch.tensor([[1.25]])
    old = torch.zeros(1, 1)
    loss, stats = grpo_loss_sum(old + ratio.log(), old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert float(loss) == pytest.approx(-1.25)  # inside [0.8, 1.28]
    assert stats["clipped_tokens"] == 0


def test_loss_k3_kl():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    # d = ref - logp = ln 0.5; k3 = e^d - d - 1 = 0.5 + ln 2 - 1
    k3 = 0.5 + math.log(2) - 1
    assert k3 == pytest.approx(0.1931472, abs=1e-7)
    loss, stats = grpo_loss_sum(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 0.2, ref, kl_coef=0.1)
    assert stats["kl_sum"] == pytest.approx(k3, rel=1e-6)
    assert float(loss) == pytest.approx(0.1 * k3, rel=1e-6)
    # kl_coef = 0 ignores the reference
    loss, stats = grpo_loss_sum(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 0.2, ref, kl_coef=0.0)
    assert float(loss) == 0.0 and "kl_sum" not in stats


def test_loss_ignores_padding_even_with_extreme_values():
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1000.0]])  # padding slot would overflow exp
    loss, _ = grpo_loss_sum(logp, old, torch.tensor([1.0]), torch.tensor([[True, False]]), 0.2, 0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0)
    assert torch.isfinite(logp.grad).all()


def test_loss_stats_stay_tensors_until_read_once():
    """The trainer reads a micro batch's stats after queueing its backward (a read is a host sync on a GPU):
    the terms are 0-d tensors, read in one go; the ratio's extremes pass over the padding (a padded ratio of
    exp(0) = 1 must not be the minimum)."""
    logp = torch.log(torch.tensor([[0.5, 0.4], [0.6, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.4], [0.4, 0.9]]))
    mask = torch.tensor([[True, False], [True, False]])
    _, terms = loss_terms(logp, old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.2)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in terms.values())
    read = host_stats(terms)
    assert read["ratio_max"] == pytest.approx(2.0) and read["ratio_min"] == pytest.approx(1.5)
    assert read["tokens"] == 2 and read["clipped_tokens"] == 1  # the first row's 2.0 is clipped at 1.2


def test_loss_stats_without_tokens_have_no_ratio_extremes():
    _, stats = grpo_loss_sum(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]), torch.zeros(1, 2), 0.2, 0.2)
    assert stats["tokens"] == 0 and "ratio_max" not in stats and "ratio_min" not in stats


# --- token_logprobs ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax_gather(temperature):
    model = tiny_model()
    ids = torch.randint(0, 32, (3, 7))
    with torch.no_grad():
        got = token_logprobs(model, ids, temperature)
        logp = torch.log_softmax(model(ids).float() / temperature, dim=-1)
    want = torch.stack([torch.stack([logp[b, t, ids[b, t + 1]] for t in range(6)]) for b in range(3)])
    assert got.shape == (3, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- GRPOTrainer ---------------------------------------------------------------------


def random_batch(model: Decoder, groups: int, rng: random.Random) -> tuple[list[Sample], list[float]]:
    """Groups of G samples with random lengths, slightly off-policy old log-probs and random rewards."""
    samples, rewards = [], []
    for g in range(groups):
        prompt = [rng.randrange(1, 32) for _ in range(rng.randint(1, 5))]
        for m in range(G):
            uid = g * G + m
            response = [] if uid == 5 else [rng.randrange(1, 32) for _ in range(rng.randint(1, 6))]
            old = [lp + rng.gauss(0, 0.3) for lp in response_logprobs(model, prompt, response)]
            samples.append(make_sample(uid, prompt, response, old))
            rewards.append(float(rng.random() < 0.5))
    return samples, group_advantages(rewards, G)


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_group_by_group_accumulation_equals_whole_batch(kl_coef):
    base = tiny_model()
    ref = copy.deepcopy(base)
    ref.model.embed_tokens.weight.data.add_(0.05)  # a reference that differs from the policy
    whole_model, grouped_model = copy.deepcopy(base), copy.deepcopy(base)
    whole = GRPOTrainer(whole_model, TrainConfig(lr=1e-3, micro_batch=64, kl_coef=kl_coef), ref_model=ref)
    grouped = GRPOTrainer(grouped_model, TrainConfig(lr=1e-3, micro_batch=1, kl_coef=kl_coef), ref_model=ref)
    rng = random.Random(0)
    samples, adv = random_batch(base, groups=4, rng=rng)
    total = sum(len(s.response_ids) for s in samples)
    for _ in range(2):  # the second step is off-policy and exercises Adam's moments
        a = whole.train_batch(samples, adv)
        order = list(range(4))
        rng.shuffle(order)
        for g in order:
            grouped.accumulate(samples[g * G : (g + 1) * G], adv[g * G : (g + 1) * G])
        b = grouped.step(total)
        assert a["tokens"] == b["tokens"] == total
        assert a["clip_frac"] > 0  # the perturbed old log-probs put some ratios outside the clip range
        for key in ("grad_norm", "pg_loss", "clip_frac", "ratio_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        if kl_coef:
            assert a["kl"] == pytest.approx(b["kl"], rel=1e-5)
    for (name, p), q in zip(whole_model.named_parameters(), grouped_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    assert not torch.equal(whole_model.lm_head.weight, base.lm_head.weight)


def test_training_raises_probability_of_rewarded_responses():
    model = tiny_model(seed=1)
    trainer = GRPOTrainer(model, TrainConfig(lr=1e-2))
    prompt, good, bad = [1, 2, 3], [5, 7], [5, 9]
    responses = [good, bad, good, bad]
    rewards = [1.0, 0.0, 1.0, 0.0]

    def p_next(token: int) -> float:
        with torch.no_grad():
            return float(torch.softmax(model(torch.tensor([prompt + [5]]))[0, -1], -1)[token])

    p_good, p_bad = p_next(7), p_next(9)
    for _ in range(15):
        samples = [make_sample(i, prompt, r, response_logprobs(model, prompt, r)) for i, r in enumerate(responses)]
        stats = trainer.train_batch(samples, group_advantages(rewards, G))
        assert stats["tokens"] == 8
        # old log-probs are the model's own, so every ratio is 1: rollout and trainer frames line up
        assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert p_next(7) > max(0.5, 3 * p_good)
    assert p_next(9) < p_bad


def test_empty_responses_contribute_nothing():
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    trainer = GRPOTrainer(model, TrainConfig())
    stats = trainer.accumulate([make_sample(0, [1, 2], [], [])], [1.0])
    assert stats == {}
    assert trainer.step()["skipped"] == 1.0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_trainer_rejects_inconsistent_inputs():
    with pytest.raises(ValueError, match="ref_model"):
        GRPOTrainer(tiny_model(), TrainConfig(kl_coef=0.1))
    trainer = GRPOTrainer(tiny_model(), TrainConfig())
    with pytest.raises(ValueError, match="logprobs"):
        trainer.accumulate([make_sample(0, [1], [2, 3], [-1.0])], [1.0])
    with pytest.raises(ValueError, match="advantages"):
        trainer.accumulate([make_sample(0, [1], [2], [-1.0])], [1.0, 2.0])
    trainer.accumulate([make_sample(0, [1], [2, 3], [-1.0, -1.0])], [1.0])
    with pytest.raises(ValueError, match="total_tokens"):
        trainer.step(total_tokens=1)


# --- TrainConfig ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", -1.0),
        ("lr", 0.0),
        ("weight_decay", -0.1),
        ("beta1", 1.0),
        ("beta2", -0.5),
        ("eps", 0.0),
        ("clip_low", 1.0),
        ("clip_high", -0.1),
        ("kl_coef", -1.0),
        ("grad_clip", -1.0),
        ("micro_batch", 0),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"train\.{field} must be .*, got {value}"):
        TrainConfig(**{field: value})


def test_config_defaults_are_valid():
    cfg = TrainConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.micro_batch, cfg.scale_by_std) == (0.2, 0.2, 64, True)
