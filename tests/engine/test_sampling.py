"""Counter-based sampling: draws depend only on (seed, position, token index)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pivotrl.engine import sample, sampling
from pivotrl.engine.sampling import Rows, filter_logits, lowbias32, row_keys, seed_key, uniforms
from pivotrl.engine.sampling import draw as draw_rows


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

M32, A, B, PHI = 0xFFFFFFFF, 0x7FEB352D, 0x846CA68B, 0x9E3779B9


def ref_open(x: int) -> int:
    """lowbias32 without its last xorshift, in Python's exact integers."""
    x &= M32
    x ^= x >> 16
    x = (x * A) & M32
    x ^= x >> 15
    return (x * B) & M32


def ref_lowbias32(x: int) -> int:
    x = ref_open(x)
    return x ^ (x >> 16)


def ref_top31(seed: int, position: int, index: int) -> int:
    """The documented draw: seed key, row key, vocabulary key, token word, its top 31 bits."""
    s = ref_lowbias32((seed & M32) ^ ref_lowbias32((seed >> 32) & M32))
    k = ref_lowbias32(s + position * PHI)
    w = ref_lowbias32((index + 1) * PHI)
    return ref_open(k ^ w) >> 1


def words(xs: list[int]) -> torch.Tensor:
    """32-bit words as int32 bit patterns."""
    return torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in xs], dtype=torch.int32)


def test_lowbias32_matches_python_reference():
    """The int32 pass (wrapping products, masked shifts) is lowbias32 bit for bit, negative words included."""
    xs = [0, 1, 7, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF, 0x80000001, 0xFFFF0000]
    got = [x & M32 for x in lowbias32(words(xs)).tolist()]
    assert got == [ref_lowbias32(x) for x in xs]


def test_lowbias32_is_a_bijection_on_a_sample():
    xs = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    xs = torch.unique(xs).to(torch.int32)
    assert len(torch.unique(lowbias32(xs))) == len(xs)


def test_seed_key_matches_reference_and_folds_every_bit():
    for seed in (0, 1, 5, 5 + 2**32, 2**40 + 3, 2**63 - 1, -5, -(2**63)):
        want = ref_lowbias32((seed & M32) ^ ref_lowbias32((seed >> 32) & M32))
        assert seed_key(seed) & M32 == want
        assert -(2**31) <= seed_key(seed) < 2**31
    assert seed_key(5) != seed_key(5 + 2**32)


def test_token_bits_match_the_documented_hash_and_the_uniforms_follow():
    seeds = [0, 1, 2**31, 2**40 + 3, -5, 123456789]
    positions = [0, 3, 100, 7, 1, 2**20]
    keys = row_keys(torch.tensor([seed_key(s) for s in seeds], dtype=torch.int32), torch.tensor(positions))
    bits = sampling._top31(keys, *(torch.empty(6, 300, dtype=torch.int32) for _ in range(2)))
    u = uniforms(torch.tensor(seeds), torch.tensor(positions), 300)
    for r, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        for i in (0, 1, 2, 17, 150, 299):
            assert int(bits[r, i]) == ref_top31(seed, pos, i), (seed, pos, i)
    want = (bits.double() + 0.5) / 2**31
    assert torch.allclose(u.double(), want, rtol=2**-23, atol=0)  # (float32: two roundings)
    small = bits < 2**23  # where the winners are: exact
    assert torch.equal(u.double()[small], want[small])


def test_uniforms_deterministic_and_open_interval():
    seeds = torch.tensor([0, 1, 2**31, 2**40 + 3, -5])
    positions = torch.tensor([0, 3, 100, 7, 1])
    u = uniforms(seeds, positions, 1000)
    assert u.dtype == torch.float32 and u.shape == (5, 1000)
    assert torch.equal(u, uniforms(seeds.clone(), positions.clone(), 1000))
    assert bool(((u > 0) & (u < 1)).all())
    # every (seed, position) row differs, and no row repeats a value much
    assert len({tuple(r) for r in u.tolist()}) == 5
    assert all(len(set(r)) > 990 for r in u.tolist())


def test_the_race_noise_at_the_ends_of_the_grid():
    """m = 0 gives E = 2**-32 (noise 22.2, the cut-off); small m keep E's relative resolution; the top m rounds
    v to 1, whose token cannot win (noise -inf)."""
    m = torch.tensor([[0, 1, 2**23 - 1, 2**30, 2**31 - 1]], dtype=torch.int32)
    c, s = sampling._affine(torch.device("cpu"), -1)
    noise = -torch.addcmul(c, m, s).log1p_().neg_().log_()[0].double()
    exact = [-math.log(-math.log1p(-(x + 0.5) / 2**31)) for x in (0, 1, 2**23 - 1, 2**30)]
    assert torch.allclose(noise[:4], torch.tensor(exact, dtype=torch.float64), rtol=1e-6, atol=0)
    assert 22.1 < float(noise[0]) < 22.3 and float(noise[-1]) == -math.inf
    assert float(noise[1] - noise[0]) == pytest.approx(-math.log(3), rel=1e-4)  # E from 0.5 to 1.5 units


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
    u = uniforms(seeds, positions, 256).double()  # 1,024,000 draws
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


def test_gumbel_noise_has_the_gumbel_moments_and_tail():
    """The race's noise -log(-log1p(-v)): mean Euler's gamma, variance pi**2/6, P(G > 3) = 1 - exp(-exp(-3))."""
    seeds = torch.arange(400).repeat_interleave(10)
    positions = torch.arange(10).repeat(400)
    g = -torch.log(-torch.log1p(-uniforms(seeds, positions, 512).double()))  # 2,048,000 draws
    assert abs(float(g.mean()) - 0.5772157) < 0.005
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.01
    tail = float((g > 3).double().mean())
    assert abs(tail - (1 - math.exp(-math.exp(-3)))) < 0.001, tail


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


def test_draws_follow_the_softmax_over_a_larger_vocabulary():
    """Chi-square of 20,000 draws over 64 tokens against softmax(logits / T), at two temperatures."""
    logits = random_logits(1, 64, seed=3, scale=1.0)[0]
    n = 20_000
    for temperature in (1.0, 0.7):
        tokens, _ = draw(logits, torch.arange(n) * 7 + 5, torch.arange(n) % 31, temperature=temperature)
        want = (logits / temperature).softmax(-1).double() * n
        counts = torch.bincount(tokens, minlength=64).double()
        chi2 = float(((counts - want) ** 2 / want).sum())
        assert chi2 < 110, chi2  # 63 degrees of freedom: mean 63, sd ~11


def test_greedy_rows_are_the_exact_argmax_beside_sampled_rows():
    """Near-ties a float round-off would break: the greedy row still takes the first largest logit."""
    logits = random_logits(4, 1000, seed=5)
    logits[0, 10], logits[0, 11] = 50.0, 50.0  # a tie: the first index wins
    logits[2, 500] = 40.0
    logits[2, 7] = torch.nextafter(torch.tensor(40.0), torch.tensor(0.0))  # one float32 step below
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.8])
    tokens, _ = sample(logits, torch.arange(4), torch.zeros(4, dtype=torch.long), temperature, torch.zeros(4),
                       torch.ones(4))  # fmt: skip
    assert int(tokens[0]) == 10 and int(tokens[2]) == 500


def test_rows_built_from_host_values_draw_what_sample_draws():
    logits = random_logits(6, 90, seed=2)
    seeds, positions = [3, 2**40, -7, 11, 12, 13], [0, 5, 9, 2, 2, 70]
    temperature, top_k, top_p = [1.0, 0.0, 0.6, 1.3, 1.0, 1.0], [0, 0, 4, 0, 0, 9], [1.0, 1.0, 1.0, 0.7, 1.0, 0.9]
    rows = Rows.build(seeds, positions, temperature, top_k, top_p, torch.device("cpu"))
    assert rows.sampled and rows.greedy and not rows.unit_temperature
    assert rows.filtered.tolist() == [2, 3, 5] and rows.top_k_max == 9 and rows.top_p_any
    got = draw_rows(logits, rows)
    want = sample(logits, *(torch.tensor(x) for x in (seeds, positions, temperature, top_k, top_p)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _Ops(TorchDispatchMode):
    """The aten ops a block runs, with their first argument's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.ops.append((func.overloadpacket.__name__, tuple(first.shape) if first is not None else ()))
        return func(*args, **(kwargs or {}))


def test_no_row_filtering_means_no_sort_and_only_filtering_rows_are_sorted():
    logits = random_logits(8, 500, seed=4)
    plain = Rows.build(list(range(8)), [0] * 8, [1.0] * 8, [0] * 8, [1.0] * 8, torch.device("cpu"))
    with _Ops() as seen:
        draw_rows(logits, plain)
    names = {name for name, _ in seen.ops}
    assert not names & {"sort", "topk", "cumsum", "index_select"}, names
    # two rows of eight filter: only they are sorted (top-p) and ranked (top-k)
    mixed = Rows.build(list(range(8)), [0] * 8, [1.0] * 8, [0, 5, 0, 0, 0, 0, 0, 0], [1.0] * 6 + [0.9, 1.0],
                       torch.device("cpu"))  # fmt: skip
    with _Ops() as seen:
        draw_rows(logits, mixed)
    assert {shape for name, shape in seen.ops if name in ("sort", "topk")} == {(2, 500)}, seen.ops
    # a batch of only unit-temperature rows is not scaled
    assert not any(name == "div" for name, _ in seen.ops)


def test_a_draw_never_reads_the_device():
    """On the meta device every read of a value (item, tolist, bool of a tensor) raises: a draw built from host
    values runs there whole, greedy, sampled and filtered rows together."""
    meta = torch.device("meta")
    rows = Rows.build([1, 2, 3, 4], [0, 1, 2, 3], [0.0, 1.0, 0.7, 1.0], [0, 0, 3, 0], [1.0, 1.0, 1.0, 0.8], meta)
    tokens, logprobs = draw_rows(torch.empty(4, 300, device=meta), rows)
    assert tokens.shape == (4,) and logprobs.shape == (4,) and tokens.device == meta
    with pytest.raises(NotImplementedError, match="no data"):  # (the check has teeth: sample() reads its tensors)
        sample(torch.empty(1, 300, device=meta), *(torch.zeros(1, device=meta) for _ in range(5)))
