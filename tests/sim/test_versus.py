"""``pivotrl simulate --versus``: the job in every mode side by side, and the split search behind its static split."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import ConfigError
from pivotrl.errors import UserError
from pivotrl.sim.versus import MODES, SYNC_MODES, best_size, format_versus, search_split, versus

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples/sim128.yaml")
# 16 GPUs, 64 prompts of 16 responses a step: each run a second or two
JOB = ["sim.gpus=16", "rollout.prompts_per_step=64", "steps=3", "eval.size=16"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("versus") / "run"
    said: list[str] = []
    return versus(EXAMPLE, JOB, out, SYNC_MODES, search_budget=4, say=said.append), out, said


def test_every_mode_runs_the_same_job_and_shiftable_is_compared_with_each(report):
    r, out, said = report
    assert list(r["modes"]) == list(SYNC_MODES)
    for mode, row in r["modes"].items():
        summary = json.loads((out / mode / "summary.json").read_text())
        config = json.loads((out / mode / "config.json").read_text())
        assert row["samples_per_s"] == summary["steady_samples_per_s"] > 0
        steps = [json.loads(x)["step_seconds"] for x in (out / mode / "metrics.jsonl").read_text().splitlines()]
        assert row["step_seconds"] == pytest.approx(sum(steps[1:]) / len(steps[1:]))  # (the first step left out)
        assert config["sim"]["gpus"] == 16 and config["rollout"]["prompts_per_step"] == 64 and config["steps"] == 3
        # no mode passes the floor: it bounds every on-policy schedule
        assert 0 < row["floor_fraction"] <= 1 and row["floor_fraction"] == pytest.approx(
            row["samples_per_s"] / r["floor_samples_per_s"]
        )
        assert not (out / f"{mode}-tp1").exists()  # the kept run is renamed to the mode
    assert json.loads((out / "deployed" / "config.json").read_text())["sim"]["costs"] == "deployed"
    assert json.loads((out / "deployed" / "config.json").read_text())["rollout"]["rebalance"] is False
    assert json.loads((out / "colocated" / "config.json").read_text())["mode"] == "colocated"
    rates = {m: row["samples_per_s"] for m, row in r["modes"].items()}
    assert r["speedup"] == pytest.approx({m: rates["shiftable"] / rates[m] for m in SYNC_MODES if m != "shiftable"})
    assert json.loads((out / "versus.json").read_text())["speedup"] == pytest.approx(r["speedup"])
    assert rates["deployed"] < rates["colocated"]  # the same schedule, its switches at their published cost
    assert any("shiftable TP1" in line for line in said)


def test_overlapping_modes_run_with_their_staleness_and_are_compared_with_their_kind(tmp_path):
    """The static split one step off-policy (its split searched so) against shiftable at k=2: each run with its
    max_staleness, the static split compared with the fastest shiftable that overlaps."""
    modes = ["disaggregated-k1", "shiftable-k2"]
    r = versus(EXAMPLE, JOB, tmp_path, modes, search_budget=2, say=lambda _: None)
    assert list(r["modes"]) == modes
    for mode, k in zip(modes, (1, 2), strict=True):
        config = json.loads((tmp_path / mode / "config.json").read_text())
        assert config["max_staleness"] == k and config["mode"] == mode.partition("-")[0]
        rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert max(x["staleness_max"] for x in rows) <= k and r["modes"][mode]["samples_per_s"] > 0
    assert 1 <= len(r["modes"]["disaggregated-k1"]["search"]) <= 2
    best = r["modes"]["shiftable-k2"]["samples_per_s"]
    assert r["speedup"] == pytest.approx({"disaggregated-k1": best / r["modes"]["disaggregated-k1"]["samples_per_s"]})
    text = format_versus(r)
    assert "shiftable, k=2" in text and "k=N: steps overlap" in text
    assert any(line.startswith("static split") and ", k=1" in line for line in text.splitlines())


def test_the_cli_runs_the_on_policy_modes_unless_told(tmp_path, capsys):
    from pivotrl.cli import _versus_modes

    assert _versus_modes("") == SYNC_MODES and _versus_modes("shiftable-k2,deployed-k1") == (
        "shiftable-k2",
        "deployed-k1",
    )
    assert set(MODES) == {*SYNC_MODES, "deployed-k1", "disaggregated-k1", "shiftable-k1", "shiftable-k2"}


def test_the_static_split_is_searched_within_its_budget_and_the_best_is_run(report):
    r, out, _ = report
    row = r["modes"]["disaggregated"]
    split = tuple(int(x.split(":")[1]) for x in row["split"].split(","))
    assert min(split) >= 1 and sum(split) == 16
    assert 1 <= len(row["search"]) <= 4
    best = min((s for s in row["search"] if "step_seconds" in s), key=lambda s: s["step_seconds"])
    assert best["split"] == row["split"]
    assert json.loads((out / "disaggregated" / "config.json").read_text())["split"] == row["split"]


def test_a_split_the_job_names_is_run_as_it_is(tmp_path):
    r = versus(EXAMPLE, [*JOB, "split=rollout:6,judge:3,train:7"], tmp_path / "run", ["disaggregated"],
               say=lambda _: None)  # fmt: skip
    row = r["modes"]["disaggregated"]
    assert row["split"] == "rollout:6,judge:3,train:7" and "search" not in row
    assert r["speedup"] == {}  # (no shiftable run to compare)


def test_a_split_the_job_names_fails_at_other_sizes_alone_and_a_mode_that_never_ran_is_reported(tmp_path):
    # the job's split names 16 instances: at 2 GPUs an instance there are 8, and that size fails by itself
    r = versus(EXAMPLE, [*JOB, "split=rollout:6,judge:3,train:7"], tmp_path / "run", ["disaggregated"], sizes=[1, 2],
               say=lambda _: None)  # fmt: skip
    row = r["modes"]["disaggregated"]
    assert row["instance_gpus"] == 1 and {t["tp"]: t["samples_per_s"] for t in row["sizes"]}[2] == 0.0
    # on 2 GPUs no static split fits (one instance a role): nothing ran, the report still says why
    r = versus(EXAMPLE, ["sim.gpus=2", "rollout.prompts_per_step=8", "steps=2", "eval.size=16"], tmp_path / "none",
               ["disaggregated"], say=lambda _: None)  # fmt: skip
    assert "cannot hold one a role" in r["modes"]["disaggregated"]["error"]
    assert json.loads((tmp_path / "none" / "versus.json").read_text())["modes"]["disaggregated"]["error"]


def test_more_seeds_average_each_mode_at_its_size_and_split(tmp_path):
    r = versus(EXAMPLE, JOB, tmp_path / "run", ["disaggregated", "shiftable"], search_budget=2, seeds=2,
               say=lambda _: None)  # fmt: skip
    for mode, row in r["modes"].items():
        assert [s["seed"] for s in row["seeds"]] == [0, 1]
        rates = [s["samples_per_s"] for s in row["seeds"]]
        assert row["samples_per_s"] == pytest.approx(sum(rates) / 2) and row["samples_per_s_range"] == [
            min(rates),
            max(rates),
        ]
        assert rates[0] == json.loads((tmp_path / "run" / mode / "summary.json").read_text())["steady_samples_per_s"]
        for seed, rate in ((1, rates[1]),):
            run = tmp_path / "run" / f"{mode}-seed{seed}"
            assert json.loads((run / "config.json").read_text())["seed"] == seed
            assert json.loads((run / "summary.json").read_text())["steady_samples_per_s"] == rate
            if mode == "disaggregated":  # (the split the first seed's search found)
                assert json.loads((run / "config.json").read_text())["split"] == row["split"]
        assert row["floor_fraction"] == pytest.approx(row["samples_per_s"] / r["floor_samples_per_s"])
    assert len(set(s["samples_per_s"] for s in r["modes"]["shiftable"]["seeds"])) > 1  # (the seed draws the lengths)
    assert r["speedup"]["disaggregated"] == pytest.approx(
        r["modes"]["shiftable"]["samples_per_s"] / r["modes"]["disaggregated"]["samples_per_s"]
    )
    with pytest.raises(UserError, match="--seeds must be >= 1"):
        versus(EXAMPLE, JOB, tmp_path / "zero", ["shiftable"], seeds=0)


def test_each_mode_is_kept_at_its_fastest_size(tmp_path):
    r = versus(EXAMPLE, JOB, tmp_path / "run", ["colocated", "shiftable"], sizes=[1, 2], say=lambda _: None)
    for mode in ("colocated", "shiftable"):
        row = r["modes"][mode]
        ran = {t["tp"]: t["samples_per_s"] for t in row["sizes"] if "samples_per_s" in t}
        assert row["instance_gpus"] == max(ran, key=ran.get)
        assert (
            json.loads((tmp_path / "run" / mode / "summary.json").read_text())["sim"]["instance_gpus"]
            == (row["instance_gpus"])
        )
        assert {t["tp"] for t in row["sizes"]} == {1, 2}
    assert r["sizes"] == [1, 2] and r["floor_samples_per_s"] >= max(
        row["floor_samples_per_s"] for row in r["modes"].values()
    )


@pytest.mark.parametrize(
    ("overrides", "kwargs", "message"),
    [
        (["mode=colocated"], {}, "leave 'mode=colocated' out of the overrides"),
        ([], {"modes": ["colocated", "static"]}, "--versus: got static, expected some of deployed"),
        ([], {"search_budget": 0}, "--search-budget must be >= 1 (got 0)"),
        (["sim.gpsu=8"], {}, "unknown key 'sim.gpsu'"),
        (["sim.costs=deployed"], {}, "--versus prices the deployed baseline itself"),
        ([], {"sizes": [1, 3]}, "--sizes 3: sim.gpus: expected a multiple of tensor_parallel (3), got 16"),
    ],
)
def test_bad_requests_stop_before_any_run(tmp_path, overrides, kwargs, message):
    with pytest.raises((UserError, ConfigError)) as e:
        versus(EXAMPLE, [*JOB, *overrides], tmp_path / "run", **{"modes": MODES, **kwargs})
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_deployed_baseline_is_not_set_beside_measured_costs(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text("{}")  # (read when a run starts: the request stops before)
    with pytest.raises(UserError, match="the deployed baseline is priced on the modeled GPUs") as e:
        versus(EXAMPLE, [*JOB, f"sim.costs={costs}"], tmp_path / "run", ["deployed", "shiftable"])
    assert f"sim.costs={costs}" in str(e.value) and not (tmp_path / "run").exists()


def test_the_cli_prints_the_table_and_exits_2_when_a_mode_cannot_run(tmp_path, capsys):
    assert main(["simulate", EXAMPLE, *JOB, "--out", str(tmp_path / "a"), "--versus", "colocated", "shiftable",
                 "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "colocated, strong" in out and "shiftable vs it" in out and "no on-policy schedule passes" in out
    report = json.loads((tmp_path / "a" / "versus.json").read_text())
    row = next(line for line in out.splitlines() if line.startswith("colocated, strong"))
    assert row.split()[-1] == f"{1 / report['modes']['colocated']['floor_fraction']:.2f}x"  # any schedule's most
    assert (tmp_path / "a" / "versus.json").exists()
    # two instances cannot hold a static split (one a role): the other mode still runs, the exit says so
    small = ["sim.gpus=2", "rollout.prompts_per_step=8", "steps=2", "eval.size=16"]
    assert main(["simulate", EXAMPLE, *small, "--out", str(tmp_path / "b"), "--versus", "disaggregated",
                 "shiftable", "--quiet"]) == 2  # fmt: skip
    out = capsys.readouterr().out
    assert "disaggregated: 2 instance(s) of 1 GPU(s) cannot hold one a role" in out
    assert (tmp_path / "b" / "shiftable" / "summary.json").exists()
    # the options that go with --versus, without it
    assert main(["simulate", EXAMPLE, *JOB, "--out", str(tmp_path / "c"), "--sizes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--sizes, --search-budget and --seeds go with --versus" in err and "Traceback" not in err


def test_versus_takes_only_mode_names_so_the_config_and_overrides_may_follow_it(tmp_path, capsys):
    small = ["sim.gpus=8", "rollout.prompts_per_step=8", "steps=2", "eval.size=16"]
    assert main(["simulate", "--versus", "shiftable", EXAMPLE, *small, "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert list(json.loads((tmp_path / "a" / "versus.json").read_text())["modes"]) == ["shiftable"]
    assert json.loads((tmp_path / "a" / "shiftable" / "config.json").read_text())["sim"]["gpus"] == 8
    assert main(["simulate", EXAMPLE, "--versus=colocated,shiftable", *small, "--out", str(tmp_path / "b"),
                 "--quiet"]) == 0  # fmt: skip
    assert list(json.loads((tmp_path / "b" / "versus.json").read_text())["modes"]) == ["colocated", "shiftable"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # (argparse's usage error)
        main(["simulate", EXAMPLE, "--versus", "shiftabel", *small, "--out", str(tmp_path / "c")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid mode 'shiftabel' (choose from deployed, colocated, disaggregated, shiftable, deployed-k1, " in err
    assert not (tmp_path / "c").exists()


# -- the split search, on a fake evaluator ---------------------------------------------------


def pipeline(work: tuple[float, float, float]):
    """A static split's step time if the slowest role sets it: work / devices, the max over roles."""

    def evaluate(split):
        return max(w / n for w, n in zip(work, split, strict=True))

    return evaluate


def every_split(devices):
    return [(r, g, devices - r - g) for r, g in itertools.product(range(1, devices), repeat=2) if devices - r - g >= 1]


@pytest.mark.parametrize(
    ("devices", "work", "seed"),
    [
        (128, (5.0, 2.0, 3.0), (64, 32, 32)),  # near the optimum
        (128, (5.0, 2.0, 3.0), (8, 100, 20)),  # far from it: the coarse grid walks
        (64, (1.0, 1.0, 8.0), (30, 30, 4)),
        (32, (8.0, 1.0, 1.0), (10, 11, 11)),
    ],
)
def test_search_lands_near_the_best_split(devices, work, seed):
    calls = []
    evaluate = pipeline(work)

    def counted(split):
        calls.append(split)
        return evaluate(split)

    best, tried = search_split(counted, devices, seed, levels=4, budget=60)
    optimum = min(evaluate(s) for s in every_split(devices))
    assert evaluate(best) <= optimum * 1.06
    assert len(calls) == len(set(calls)) == len(tried)  # no split run twice
    assert all(min(s) >= 1 and sum(s) == devices for s in calls)
    assert tried[0][0] == seed and best == min(tried, key=lambda t: t[1])[0]


def test_search_stops_at_its_budget_and_skips_failed_runs():
    evaluate = pipeline((5.0, 2.0, 3.0))
    best, tried = search_split(lambda s: math.inf if s[1] > 30 else evaluate(s), 128, (40, 40, 48), budget=7)
    assert len(tried) == 7
    assert best[1] <= 30


def test_search_refuses_a_bad_seed():
    with pytest.raises(ValueError, match="not a split"):
        search_split(lambda s: 1.0, 8, (8, 0, 0))


def test_best_size_tries_the_highest_bound_first_and_skips_sizes_that_cannot_win():
    caps = {1: 90.0, 2: 110.0, 4: 120.0, 8: 70.0}
    measured = {1: 75.0, 2: 85.0, 4: 80.0, 8: 60.0}
    ran = []

    def run(tp):
        ran.append(tp)
        return measured[tp]

    tp, tried = best_size(caps, run)
    assert tp == 2 and ran == [4, 2, 1]  # TP8's bound (70) is below the best run (85): not run
    assert [t["tp"] for t in tried] == [4, 2, 1, 8] and "skipped" in tried[-1]
    # every run failing: no size
    assert best_size({1: 90.0}, lambda tp: 0.0) == (None, [{"tp": 1, "samples_per_s": 0.0}])
