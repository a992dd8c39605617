import random
import statistics

import pytest

from pivotrl.sim.workload import LengthDist, LengthKind, SimWorkload, correlated, group_correlation, replay_table

DISTS = {
    "fixed": LengthDist.fixed(300, cap=256),
    "uniform": LengthDist.uniform(10, 1000, cap=800),
    "lognormal": LengthDist.lognormal(300, 1.2, cap=1024),
    "pareto": LengthDist.pareto(100, 1.5, cap=4096),
    "pareto_alpha_1": LengthDist.pareto(50, 1.0, cap=2000),
}


@pytest.mark.parametrize("name", DISTS)
def test_sampling_is_deterministic_and_capped(name):
    dist = DISTS[name]
    a = dist.sample(random.Random(7), 5000)
    assert a == dist.sample(random.Random(7), 5000)
    assert all(isinstance(x, int) and 1 <= x <= dist.cap for x in a)


@pytest.mark.parametrize("name", DISTS)
def test_mean_matches_the_samples(name):
    dist = DISTS[name]
    samples = dist.sample(random.Random(0), 50_000)
    assert statistics.fmean(samples) == pytest.approx(dist.mean(), rel=0.03)


def test_the_caps_above_do_bind():
    assert DISTS["fixed"].mean() == 256
    assert DISTS["uniform"].mean() < (10 + 1000) / 2
    assert DISTS["lognormal"].mean() < 300 * 2.0545  # uncapped: median * exp(sigma^2 / 2)
    assert DISTS["pareto"].mean() < 300  # uncapped: minimum * alpha / (alpha - 1)


def test_pareto_has_a_heavier_tail_than_uniform():
    def tail(dist: LengthDist) -> float:
        s = sorted(dist.sample(random.Random(1), 20_000))
        return s[int(0.99 * len(s))] / s[len(s) // 2]

    assert tail(LengthDist.pareto(100, 1.2, cap=8192)) > 3 * tail(LengthDist.uniform(100, 2000))


def test_a_huge_pareto_draw_is_capped_not_overflowed():
    assert max(LengthDist.pareto(1, 0.01, cap=1000).sample(random.Random(3), 1000)) == 1000


def test_trace_files_load(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"length": 10, "uid": 3}\n20\n\n{"length": 4000}\n')
    dist = LengthDist.from_trace(path)
    assert dist.kind is LengthKind.TRACE and dist.lengths == (10, 20, 4000) and dist.cap == 4000
    assert set(dist.sample(random.Random(0), 200)) == {10, 20, 4000}
    capped = LengthDist.from_trace(path, cap=100)
    assert capped.mean() == pytest.approx((10 + 20 + 100) / 3)
    assert max(capped.sample(random.Random(0), 200)) == 100


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('10\n{"len": 3}\n', "lengths.jsonl:2: expected an int"),
        ("10\n\n-4\n", "lengths.jsonl:3: expected an int"),
        ("10\n{oops\n", "lengths.jsonl:2: not JSON"),
        ("10\n2.5\n", "lengths.jsonl:2: expected"),
        ("\n\n", "lengths.jsonl: no lengths"),
    ],
)
def test_bad_trace_lines_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "lengths.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        LengthDist.from_trace(path)


def test_from_dict(tmp_path):
    assert LengthDist.from_dict({"kind": "lognormal", "median": 300, "sigma": 0.8, "cap": 2048}) == (
        LengthDist.lognormal(300, 0.8, cap=2048)
    )
    (tmp_path / "t.jsonl").write_text("5\n6\n")
    assert LengthDist.from_dict({"kind": "trace", "path": str(tmp_path / "t.jsonl")}).lengths == (5, 6)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "gamma", "cap": 10}, "kind: got 'gamma', allowed: fixed, uniform, lognormal, pareto, trace"),
        ({"kind": "lognormal", "median": 300, "cap": 10}, "lognormal length distribution: sigma is missing"),
        ({"kind": "fixed", "value": 3, "lo": 1, "cap": 10}, "lo is not one of its parameters"),
        ({"kind": "fixed", "value": 3}, "cap is missing"),
        ({"kind": "fixed", "value": 3, "cap": 10, "shape": 2}, "unknown keys \\['shape'\\]"),
        ({"kind": "uniform", "lo": 30, "hi": 20, "cap": 10}, "uniform.hi: got 20, must be >= lo"),
        ({"kind": "pareto", "minimum": 1, "alpha": 0, "cap": 10}, "pareto.alpha: got 0"),
        ({"kind": "fixed", "value": 3, "cap": 0}, "cap: got 0"),
    ],
)
def test_bad_distributions_say_what_is_allowed(data, message):
    with pytest.raises(ValueError, match=message):
        LengthDist.from_dict(data)


def test_describe():
    assert DISTS["lognormal"].describe() == "lognormal(median=300, sigma=1.2, cap=1024)"


def workload(**changes) -> SimWorkload:
    base = {
        "prompts_per_step": 64,
        "group_size": 8,
        "prompt_len": 200,
        "response_len": LengthDist.lognormal(400, 0.8, cap=2048),
        "judge_template_len": 150,
        "judge_output_len": 96,
        "policy": "Qwen2.5-7B",
        "judge": "Qwen2.5-3B",
    }
    return SimWorkload(**{**base, **changes})


def test_a_workload():
    w = workload()
    assert w.samples_per_step == 512
    assert w.judge_output_dist == LengthDist.fixed(96)
    assert w.judge_prompt_len(400) == 200 + 400 + 150
    assert w.policy_model.name == "Qwen2.5-7B" and w.judge_model.name == "Qwen2.5-3B"
    judge = LengthDist.uniform(32, 256)
    assert workload(judge_output_len=judge).judge_output_dist is judge


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompts_per_step": 0}, "prompts_per_step: got 0, must be an int >= 1"),
        ({"group_size": 2.0}, "group_size: got 2.0"),
        ({"judge_template_len": -1}, "judge_template_len: got -1, must be an int >= 0"),
        ({"response_len": 512}, "response_len: got 512, must be a LengthDist"),
        ({"judge_output_len": 0}, "judge_output_len: got 0"),
        ({"policy": "gpt-4"}, "policy: got 'gpt-4', known models: Qwen2.5-1.5B"),
    ],
)
def test_a_bad_workload_says_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        workload(**change)


def test_correlated_draws_keep_their_distribution_and_share_their_groups():
    rng = random.Random(3)
    assert correlated(0.2, 0.7, 0.0) == 0.7 and correlated(0.2, 0.7, 1.0) == 0.2
    draws = [correlated(rng.random(), rng.random(), 0.5) for _ in range(20_000)]
    assert all(0 <= u < 1 for u in draws)
    assert statistics.fmean(draws) == pytest.approx(0.5, abs=0.01)  # still uniform
    assert statistics.fmean(u < 0.1 for u in draws) == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match=r"rho: got 1.5, must be in \[0, 1\]"):
        correlated(0.5, 0.5, 1.5)


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.7, 1.0])
def test_group_correlation_measures_what_correlated_draws(rho):
    rng, dist = random.Random(rho), LengthDist.lognormal(300, 0.8, cap=100_000)
    groups = []
    for _ in range(500):
        shared = rng.random()
        groups.append([dist.quantile(correlated(shared, rng.random(), rho)) for _ in range(8)])
    assert group_correlation(groups) == pytest.approx(rho, abs=0.06)


def test_group_correlation_of_degenerate_groups():
    assert group_correlation([[5, 5], [7, 7]]) == 1.0
    assert group_correlation([[5, 5], [5, 5]]) == 0.0  # no two lengths differ: nothing to correlate
    assert group_correlation([[5], [7]]) == 0.0  # groups of one say nothing


def test_a_replay_table_reads_rows_with_step_uid_and_length(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"step": 1, "uid": 0, "length": 12}\n17\n{"step": 2, "uid": 3, "length": 40, "x": 1}\n')
    assert replay_table(path) == {(1, 0): 12, (2, 3): 40}
    path.write_text("17\n")
    with pytest.raises(ValueError, match='no rows to replay \\(each needs int "step", "uid" and "length"\\)'):
        replay_table(path)
