"""Stand-in texts: verdicts the job's GenRM parses, responses the rule checker reads, seeded draws."""

from __future__ import annotations

import pytest

from pivotrl.config import load_config
from pivotrl.reward.genrm import GenRM, Outcome
from pivotrl.sim import synthetic
from pivotrl.sim.config import LengthsConfig
from pivotrl.sim.workload import LengthDist
from pivotrl.task.rules import exact_match


@pytest.mark.parametrize(
    "pattern, labels",
    [
        ("VERDICT: *(yes|no)", ("yes", "no")),
        (r"\[\[(\w+)\]\]", ("A", "B")),
        (r"(?i)final answer:\s*(correct|incorrect)\s*$", ("correct", "incorrect")),
        (r"Score: (\d)/5", ("5", "1")),
        (r"<verdict>(pass|fail)</verdict>", ("pass", "fail")),
    ],
)
def test_verdict_texts_parse_to_their_label(pattern, labels):
    genrm = GenRM("{response}", pattern, {labels[0]: 1.0, labels[1]: 0.0}, 0.0)
    for label in labels:
        text = synthetic.verdict_text(genrm, label)
        assert text is not None
        j = genrm.score(text)
        assert (j.label, j.outcome) == (label, Outcome.PARSED)


def test_a_pattern_that_cannot_give_the_label_is_reported():
    genrm = GenRM("{response}", r"VERDICT: (y|n)", {"yes": 1.0, "no": 0.0}, 0.0)
    assert synthetic.verdict_text(genrm, "yes") is None


def test_responses_read_as_right_or_wrong_and_carry_their_length():
    right, wrong = synthetic.response_text(1234, True), synthetic.response_text(7, False)
    assert exact_match(right, synthetic.REFERENCE) and not exact_match(wrong, synthetic.REFERENCE)
    assert synthetic.response_tokens(right) == 1234 and synthetic.response_tokens(wrong) == 7
    assert synthetic.response_tokens("a response from elsewhere") == 4


def test_draws_are_fixed_by_their_keys_and_uniform():
    assert synthetic.unit(1, 2, 3) == synthetic.unit(1, 2, 3) != synthetic.unit(1, 2, 4)
    draws = [synthetic.unit(0, seed, 7, synthetic.LENGTH) for seed in range(20_000)]
    assert all(0 <= u < 1 for u in draws) and abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert sum(u < 0.1 for u in draws) == pytest.approx(2000, rel=0.08)


@pytest.mark.parametrize(
    "dist",
    [
        LengthDist.lognormal(800, 0.9, 8192),
        LengthDist.pareto(200, 1.5, 4096),
        LengthDist.uniform(10, 90),
        LengthDist.fixed(33, cap=20),
        LengthDist(kind="trace", cap=100, lengths=(5, 50, 500)),
    ],
    ids=lambda d: d.kind.value,
)
def test_quantile_draws_follow_the_distribution(dist):
    draws = [dist.quantile(synthetic.unit(3, i)) for i in range(40_000)]
    assert all(1 <= n <= dist.cap for n in draws)
    assert sum(draws) / len(draws) == pytest.approx(dist.mean(), rel=0.03)
    assert dist.quantile(0.2) <= dist.quantile(0.5) <= dist.quantile(0.9)


def test_the_lengths_section_uses_only_its_kinds_parameters():
    cfg = load_config(None, ["sim.lengths.kind=pareto", "sim.lengths.minimum=100", "sim.lengths.alpha=2"])
    assert cfg.sim.lengths.dist(512) == LengthDist.pareto(100, 2.0, 512)
    assert LengthsConfig(kind="fixed", value=7).dist(5) == LengthDist.fixed(7, cap=5)
    assert load_config(None, ["sim.gpus=16", "sim.instance_gpus=4"]).sim.devices == 4
