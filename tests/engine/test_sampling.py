"""Counter-based sampling: draws depend only on (seed, position, token index)."""

import pytest
import torch

from pivotrl.engine import sample
from pivotrl.engine.sampling import filter_logits, mix32, uniforms


def draw(logits, seeds, positions=None, temperature=1.0, top_k=0, top_p=1.0):
    """sample() with per-row parameters broadcast from scalars."""
    seeds = torch.as_tensor(seeds)
    b = len(seeds)
    if logits.dim() == 1:
        logits = logits.expand(b, -1)
    positions = torch.zeros(b, dtype=torch.long) if positions is None else torch.as_tensor(positions)
    return sample(
        logits,
        seeds,
        positions,
        torch.full((b,), float(temperature)),
        torch.full((b,), top_k),
        torch.full((b,), float(top_p)),
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# -- the hash -------------------------------------------------------------------------------------------


def test_mix32_stays_in_32_bits_and_is_deterministic():
    x = torch.tensor([0, 1, 2, 2**31, 2**32 - 1, 2**40 + 5, -1], dtype=torch.int64)
    a, b = mix32(x), mix32(x.clone())
    assert torch.equal(a, b)
    assert bool(((a >= 0) & (a < 2**32)).all())
    assert len(set(a[:5].tolist())) == 5


def test_mix32_matches_python_reference():
    """lowbias32 computed with Python ints (no overflow): the split multiply in int64 is exact."""

    def ref(x: int) -> int:
        m = 0xFFFFFFFF
        x &= m
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m
        x ^= x >> 15
        x = (x * 0x846CA68B) & m
        return x ^ (x >> 16)

    xs = [0, 1, 7, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    assert mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == [ref(x) for x in xs]


def test_uniforms_deterministic_and_open_interval():
    seeds = torch.tensor([0, 1, 2**31, 2**40 + 3, -5])
    positions = torch.tensor([0, 3, 100, 7, 1])
    u = uniforms(seeds, positions, 1000)
    assert u.dtype == torch.float64 and u.shape == (5, 1000)
    assert torch.equal(u, uniforms(seeds.clone(), positions.clone(), 1000))
    assert bool(((u > 0) & (u < 1)).all())
    # every (seed, position) row differs, and no row repeats a value much
    assert len({tuple(r) for r in u.tolist()}) == 5
    assert all(len(set(r)) > 990 for r in u.tolist())


def test_uniforms_row_independent_of_batch():
    seeds = torch.arange(20) * 7919 + 11
    positions = torch.arange(20) % 6
    batch = uniforms(seeds, positions, 64)
    for i in range(20):
        assert torch.equal(uniforms(seeds[i : i + 1], positions[i : i + 1], 64)[0], batch[i])
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniforms(seeds[perm], positions[perm], 64), batch[perm])


def test_uniforms_prefix_of_larger_vocab():
    """Index i's draw does not depend on the vocabulary size (padding the vocab changes nothing)."""
    seeds, positions = torch.tensor([3, 4]), torch.tensor([0, 9])
    assert torch.equal(uniforms(seeds, positions, 50), uniforms(seeds, positions, 80)[:, :50])


def test_high_seed_bits_matter():
    low = torch.tensor([5])
    high = low + 2**32
    assert not torch.equal(uniforms(low, torch.tensor([0]), 32), uniforms(high, torch.tensor([0]), 32))


def test_uniforms_roughly_uniform_and_uncorrelated():
    seeds = torch.arange(500).repeat_interleave(8)
    positions = torch.arange(8).repeat(500)
    u = uniforms(seeds, positions, 256)  # 1,024,000 draws
    assert abs(float(u.mean()) - 0.5) < 0.002
    assert abs(float(u.var()) - 1 / 12) < 0.002
    bins = 20
    counts = torch.histc(u.float(), bins=bins, min=0, max=1)
    expected = u.numel() / bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60, chi2  # 19 degrees of freedom: mean 19, sd ~6
    # neighbouring tokens, neighbouring positions and neighbouring seeds are uncorrelated
    c = u - 0.5
    grid = c.view(500, 8, 256)
    for a, b in [
        (c[:, :-1], c[:, 1:]),
        (grid[:, :-1], grid[:, 1:]),
        (grid[:-1], grid[1:]),
    ]:
        corr = float((a * b).mean() / (c * c).mean())
        assert abs(corr) < 0.01, corr


# -- sample() --------------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    logits = random_logits(64, 50)
    for t in (0.0, -1.0):
        tokens, _ = draw(logits, torch.arange(64), temperature=t)
        assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_one_is_argmax_whatever_the_seed():
    logits = random_logits(1, 50)[0]
    tokens, _ = draw(logits, torch.arange(500), torch.arange(500) % 13, temperature=5.0, top_k=1)
    assert bool((tokens == logits.argmax()).all())


def test_tiny_top_p_is_argmax():
    logits = random_logits(1, 50)[0]
    tokens, _ = draw(logits, torch.arange(500), temperature=5.0, top_p=1e-6)
    assert bool((tokens == logits.argmax()).all())


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_stays_in_top_k(k):
    logits = random_logits(1, 30, scale=0.3)[0]  # flat: without the filter most draws would fall outside
    top = set(logits.topk(k).indices.tolist())
    tokens, _ = draw(logits, torch.arange(2000), temperature=2.0, top_k=k)
    drawn = set(tokens.tolist())
    assert drawn <= top
    assert drawn == top  # and every one of them is reachable


def test_top_p_stays_in_nucleus():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    probs = logits.softmax(-1)
    nucleus = 3  # mass before token 2 is < 0.9, before token 3 it is >= 0.9
    assert float(probs[:2].sum()) < 0.9 <= float(probs[:3].sum())
    tokens, _ = draw(logits, torch.arange(3000), top_p=0.9)
    assert set(tokens.tolist()) == set(range(nucleus))
    freq = torch.bincount(tokens, minlength=6)[:nucleus].double() / 3000
    want = probs[:nucleus] / probs[:nucleus].sum()
    assert float((freq - want).abs().max()) < 0.03


def test_top_k_larger_than_vocab_keeps_all():
    scaled = random_logits(2, 8)
    assert torch.equal(filter_logits(scaled, torch.tensor([100, 8]), torch.ones(2)), scaled)


def test_filters_apply_per_row():
    scaled = random_logits(3, 10)
    out = filter_logits(scaled, torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 1e-6]))
    assert torch.equal(out[0], scaled[0])
    assert int(torch.isfinite(out[1]).sum()) == 3
    assert int(torch.isfinite(out[2]).sum()) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.6])
    n = 4000
    tokens, _ = draw(logits, torch.arange(n) * 3 + 1, torch.arange(n) % 17, temperature=temperature)
    freq = torch.bincount(tokens, minlength=4).double() / n
    want = (logits / temperature).softmax(-1).double()
    assert float((freq - want).abs().max()) < 0.03, (freq, want)


def test_same_seed_different_positions_vary():
    logits = torch.zeros(8)
    tokens, _ = draw(logits, torch.full((200,), 42), torch.arange(200))
    assert len(set(tokens.tolist())) == 8


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        pytest.param(1.0, 0, 1.0, id="plain"),
        pytest.param(0.7, 0, 1.0, id="cold"),
        pytest.param(1.3, 5, 1.0, id="top-k"),
        pytest.param(1.0, 0, 0.8, id="top-p"),
        pytest.param(0.0, 0, 1.0, id="greedy"),
    ],
)
def test_logprob_is_unfiltered_tempered_log_softmax(temperature, top_k, top_p):
    logits = random_logits(32, 40)
    tokens, logprobs = draw(logits, torch.arange(32), temperature=temperature, top_k=top_k, top_p=top_p)
    t = temperature if temperature > 0 else 1.0
    want = torch.log_softmax(logits / t, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert logprobs.dtype == torch.float32
    assert torch.allclose(logprobs, want, atol=1e-6, rtol=0)


def test_mixed_rows_in_one_batch():
    """Greedy, top-k and plain rows together give what each gives alone."""
    logits = random_logits(3, 40)
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    temperature, top_k, top_p = torch.tensor([0.0, 1.0, 1.5]), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.9])
    tokens, logprobs = sample(logits, seeds, positions, temperature, top_k, top_p)
    for i in range(3):
        one = sample(*(x[i : i + 1] for x in (logits, seeds, positions, temperature, top_k, top_p)))
        assert int(one[0]) == int(tokens[i])
        assert float(one[1]) == float(logprobs[i])
    assert int(tokens[0]) == int(logits[0].argmax())
