"""The paper benchmark's helpers: the steady window of a run, the reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts import their neighbours

import paper  # noqa: E402

from pivotrl.config import load_config  # noqa: E402


def write_run(path: Path) -> None:
    """Two devices, three steps ending at 10, 20 and 30 s; the measured window is 10..30."""
    path.mkdir()
    summary = {"samples": 30, "steps": 3, "devices": 2, "steady_samples_per_s": 1.0}
    (path / "summary.json").write_text(json.dumps(summary))
    # step s, shifts, shift s, migrations, rollout s
    steps = [(12.0, 4, 6.0, 0, 11.0), (10.0, 2, 2.0, 1, 7.0), (10.0, 4, 3.0, 3, 8.0)]
    (path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step_seconds": s,
                    "shifts": n,
                    "shift_seconds": x,
                    "migrations": m,
                    "time_s": {"rollout": r, "step": s},
                    "group_wait_s": {"median": r / 2, "p90": r, "max": s},
                }
            )
            + "\n"
            for s, n, x, m, r in steps
        )  # fmt: skip
    )
    spans = [
        (0, "rollout", "rollout 5 done", 0.0, 15.0),  # 5 s in the window
        (1, "train", "step v0->v1", 9.0, 10.0),
        (0, "train", "step v1->v2", 19.0, 20.0),
        (1, "train", "step v1->v2", 19.0, 20.0),
        (1, "shift", "train->genrm", 20.0, 22.0),  # a move
        (0, "shift", "rollout->rollout", 20.0, 21.0),  # a weight reload, no move
        (1, "genrm", "genrm 3 done", 22.0, 29.0),
        (0, "train", "step v2->v3", 29.0, 30.0),
        (1, "train", "step v2->v3", 29.0, 30.0),
        (0, "rollout", "eval", 30.0, 50.0),  # after the last step: outside
    ]
    (path / "events.jsonl").write_text(
        "".join(
            json.dumps({"device": d, "role": r, "name": n, "start": a, "end": b, "args": {}}) + "\n"
            for d, r, n, a, b in spans
        )  # fmt: skip
    )


def test_steady_window_leaves_out_the_first_step(tmp_path):
    write_run(tmp_path / "run")
    s = paper.steady(tmp_path / "run")
    assert s["step_seconds"] == 10.0  # (samples/s is the run's own steady_samples_per_s)
    assert s["busy_fraction"] == pytest.approx({"rollout": 5 / 40, "genrm": 7 / 40, "train": 4 / 40, "shift": 3 / 40})
    assert s["idle_fraction"] == pytest.approx(21 / 40)
    assert (s["shifts_per_step"], s["moves_per_step"], s["shift_seconds_per_step"]) == (3.0, 0.5, 2.5)
    assert s["migrations_per_step"] == 2.0
    assert s["rollout_seconds"] == 7.5
    assert s["group_wait_s"] == pytest.approx({"median": 3.75, "p90": 7.5, "max": 10.0})  # the steady steps'


def test_tail_points_keep_the_mean_length():
    means = {}
    for label, extra in paper.tail_points():
        cfg = load_config(paper.EXAMPLE, extra)
        means[label] = cfg.sim.lengths.dist(cfg.rollout.max_new_tokens).mean()
    assert list(means)[0] == "uniform" and list(means)[-1].startswith("pareto")
    base = means["lognormal s=0.9"]
    assert all(m == pytest.approx(base, rel=0.01) for m in means.values()), means


def test_reasoning_points_spread_the_judgments_and_leave_about_one_percent_at_the_cap():
    for label, extra in paper.reasoning_points():
        cfg = load_config(paper.EXAMPLE, extra)
        dist = cfg.sim.judge_lengths(cfg.judge.max_new_tokens)
        capped = sum(dist.quantile((i + 0.5) / 1000) >= dist.cap for i in range(1000)) / 1000
        assert cfg.sim.judge_output_sigma > 0 and 0.002 < capped < 0.02, (label, capped)
        assert dist.quantile(0.5) == cfg.sim.judge_output_len


OLD_MODES = ("colocated", "disaggregated", "shiftable")  # reports before the deployed baseline


def fake_report(tmp_path: Path) -> Path:
    """A report of one group run at 32 GPUs, its ideal left out as an older report might have it."""
    modes = {m: {"samples_per_s": rate, "step_seconds": 8192 / rate, "busy_fraction": dict.fromkeys(
        (*paper.ROLES, "shift"), 0.2), "idle_fraction": 0.2, "shifts_per_step": 1.0, "moves_per_step": 1.0,
        "shift_seconds_per_step": 1.0} for m, rate in zip(OLD_MODES, (10.0, 8.0, 12.0), strict=True)}  # fmt: skip
    overrides = paper.job_overrides(paper.GROUPS["dense-7b"], 32, 1)
    group = {"name": "dense-7b", "what": "dense pair", "policy": "Qwen2.5-7B", "genrm": "Qwen2.5-7B", "gpus": 32,
             "instance_gpus": 1, "devices": 32, "overrides": overrides, "ideal": {}, "modes": modes}  # fmt: skip
    report = {"code": "abc", "settings": {"gpus": 32}, "wall_s": 60.0, "groups": [group]}
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(report))
    return path


def test_rerender_recomputes_the_ideal_and_the_bounds_and_keeps_the_runs(tmp_path):
    path = fake_report(tmp_path)
    paper.rerender(path, tmp_path / "out")
    g = json.loads((tmp_path / "out.json").read_text())["groups"][0]
    i = g["ideal"]
    assert i["spread_path_s"] > i["critical_path_s"] > 0
    assert i["floor_seconds"] == max(i["step_seconds"], i["spread_path_s"], i["joint_floor_s"], i["group_path_s"])
    ceiling = i["samples_per_s"] * i["step_seconds"] / i["floor_seconds"]
    assert g["bound_vs_colocated"] == pytest.approx(ceiling / 10.0)
    assert g["bound_vs_disaggregated"] == pytest.approx(ceiling / 8.0)
    assert g["speedup_vs_colocated"] == pytest.approx(1.2) and g["modes"]["shiftable"]["samples_per_s"] == 12.0
    assert "spread path" in (tmp_path / "out.md").read_text() and (tmp_path / "out.png").stat().st_size > 0


def test_rerender_refuses_what_is_not_a_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": []}')
    with pytest.raises(SystemExit, match="not a report of this script"):
        paper.rerender(bad, None)


def test_spent_splits_a_modes_time_into_the_work_and_what_is_beyond_it():
    busy = {"rollout": 0.5, "genrm": 0.2, "train": 0.15, "shift": 0.05}
    g = {
        "ideal": {"gpu_seconds_by_role": {"rollout": 2.0, "genrm": 1.0, "train": 1.0}},
        "ideal_fraction": {"colocated": 0.4},
        "modes": {"colocated": {"busy_fraction": busy, "idle_fraction": 0.1}, "shiftable": {"error": "timeout"}},
    }
    x = paper.spent(g, "colocated")
    # the ideal's work is 40% of the time: rollout 20%, judge 10%, train 10%; the rest of each role's busy is beyond
    assert x == pytest.approx({"work": 0.4, "rollout": 0.3, "genrm": 0.1, "train": 0.05, "shift": 0.05, "idle": 0.1})
    assert sum(x.values()) == pytest.approx(1.0)
    assert paper.spent(g, "shiftable") is None


def fake_ideal(floor_rate: float, samples_per_s: float = 200.0) -> dict[str, float]:
    """An ideal of 8192 samples a step whose floor allows ``floor_rate`` samples/s."""
    return {"samples_per_s": samples_per_s, "step_seconds": 8192 / samples_per_s, "floor_seconds": 8192 / floor_rate}


def test_with_tp_replaces_the_instance_size():
    base = paper.job_overrides(paper.GROUPS["judge-32b"], 128, 2)
    out = paper.with_tp(base, 4)
    assert "sim.instance_gpus=4" in out and "sim.instance_gpus=2" not in out and len(out) == len(base)
    assert load_config(paper.EXAMPLE, out).sim.instance_gpus == 4


def test_the_bound_is_the_best_floor_over_the_sizes_and_spent_uses_each_modes_own_ideal():
    busy = {"rollout": 0.5, "genrm": 0.2, "train": 0.15, "shift": 0.05}
    at2 = {**fake_ideal(100.0, 200.0), "gpu_seconds_by_role": {"rollout": 2.0, "genrm": 1.0, "train": 1.0}}
    at4 = {**fake_ideal(120.0, 160.0), "gpu_seconds_by_role": {"rollout": 1.0, "genrm": 1.0, "train": 2.0}}
    g = {"instance_gpus": 2, "ideal": at2, "ideals": {"2": at2, "4": at4},
         "modes": {m: {"samples_per_s": 80.0, "busy_fraction": busy, "idle_fraction": 0.1, "instance_gpus": 4,
                       "step_seconds": 102.4, "shifts_per_step": 1.0, "moves_per_step": 1.0,
                       "shift_seconds_per_step": 1.0} for m in paper.MODES}}  # fmt: skip
    g["modes"]["deployed"]["samples_per_s"] = 40.0
    g = paper.derive(g)
    assert paper.bound(g) == pytest.approx(120.0) and paper.bound_tp(g) == "4"
    # each mode over the floor's throughput; shiftable over the colocated baseline users run
    assert g["floor_fraction"] == pytest.approx({"deployed": 40 / 120, "colocated": 80 / 120,
                                                 "disaggregated": 80 / 120, "shiftable": 80 / 120})  # fmt: skip
    assert g["speedup_vs_deployed_colocated"] == pytest.approx(2.0)
    assert g["bound_vs_deployed_colocated"] == pytest.approx(3.0)
    assert [paper.LABELS[m] for m in paper.modes_of(g)] == ["colocated, deployed", "colocated, strong",
                                                            "disaggregated", "shiftable"]  # fmt: skip
    assert g["ideal_fraction"]["shiftable"] == pytest.approx(80.0 / 200.0)  # of the highest ideal
    x = paper.spent(g, "colocated")  # at TP4: the work is half of the time, a quarter of it rollout
    want = {"work": 0.5, "rollout": 0.375, "genrm": 0.075, "train": -0.1, "shift": 0.05, "idle": 0.1}
    assert x == pytest.approx(want) and paper.mode_tp(g, "colocated") == 4
    assert "lockstep_bound" not in g and paper.lockstep_text(g) == ""  # (a trainer that backpropagates when judged)


def test_a_trainer_that_backpropagates_at_the_step_is_held_to_its_own_floor():
    # FSDP2's floor at each size: 8192 samples in 102.4 s at TP2 (80/s), 81.92 s at TP4 (100/s)
    at2 = {**fake_ideal(100.0, 200.0), "lockstep_floor_s": 102.4}
    at4 = {**fake_ideal(120.0, 160.0), "lockstep_floor_s": 81.92}
    g = {"instance_gpus": 4, "ideal": at4, "ideals": {"2": at2, "4": at4},
         "modes": {m: {"samples_per_s": 90.0} for m in paper.MODES}}  # fmt: skip
    g = paper.derive(g)
    assert paper.lockstep_bound(g) == pytest.approx(100.0) == g["lockstep_bound"]
    assert g["lockstep_of_floor"] == pytest.approx(100.0 / 120.0)  # no schedule of it reaches the floor
    assert g["lockstep_floor_fraction"]["shiftable"] == pytest.approx(0.9)
    assert g["floor_fraction"]["shiftable"] == pytest.approx(0.75)  # (the joint floor's fraction as before)
    text = paper.lockstep_text(g)
    assert "shorter than 82 s (TP4)" in text and "83% of the floor" in text and "shiftable at 90%" in text


def test_gap_says_when_shiftables_rollout_ends_and_how_long_after_it_the_update_comes():
    i = {**fake_ideal(100.0), "spread_rollout_s": 55.0, "after_s": 8.0}
    run = {"samples_per_s": 90.0, "step_seconds": 81.0, "rollout_seconds": 64.0, "instance_gpus": 4,
           "shift_seconds_per_step": 64.0}  # fmt: skip
    g = {"gpus": 128, "ideals": {"4": i}, "modes": {"shiftable": run}}
    line = paper.gap(g)
    assert "rollout ends at 64.0 s (spread path 55.0 s)" in line and "17.0 s later (the joint floor's 8.0 s)" in line
    assert "shifts 2.0 s a device" in line  # 64 device-seconds over 32 instances of 4 GPUs
    assert "judge" not in line  # (a report without the judge's busy time)
    # the judge busy a fifth of the step, against the floor's 640 + 1920 GPU-seconds of its work on 128 GPUs
    busy = {**run, "busy_fraction": {"rollout": 0.5, "genrm": 0.2, "train": 0.2, "shift": 0.0}, "idle_fraction": 0.1}
    priced = {**i, "gpu_seconds": {"genrm_prefill": 640.0, "genrm_decode": 1920.0}}
    line = paper.gap({**g, "ideals": {"4": priced}, "modes": {"shiftable": busy}})
    assert "the judge keeps it 16.2 s against the floor's 20.0 s, and it idles 8.1 s" in line
    assert "waits" not in line  # (a run without group waits)
    waits = {**busy, "group_wait_s": {"median": 12.5, "p90": 20.0, "max": 30.0}}
    line = paper.gap({**g, "ideals": {"4": priced}, "modes": {"shiftable": waits}})
    assert "a group waits 12.5 s for its judgments (median)" in line
    assert paper.gap({**g, "ideals": {"4": fake_ideal(100.0)}}) is None  # an older report


def test_update_runs_only_the_modes_named_and_keeps_the_others(tmp_path, monkeypatch):
    path = fake_report(tmp_path)
    ran = []

    def fake_simulate(overrides, timeout, keep=None):
        mode = next(x.split("=")[1] for x in overrides if x.startswith("mode="))
        ran.append(mode)
        return {"wall_s": 1.0, "samples_per_s": 20.0, "step_seconds": 8192 / 20.0, "rollout_seconds": 300.0,
                "busy_fraction": dict.fromkeys((*paper.ROLES, "shift"), 0.2), "idle_fraction": 0.2,
                "shifts_per_step": 1.0, "moves_per_step": 1.0, "shift_seconds_per_step": 1.0}  # fmt: skip

    monkeypatch.setattr(paper, "simulate", fake_simulate)
    monkeypatch.setattr(sys, "argv", ["paper.py", "--update", str(path), "--out", str(tmp_path / "new")])
    paper.main()
    g = json.loads((tmp_path / "new.json").read_text())["groups"][0]
    assert set(ran) == {"shiftable"}  # at each instance size tried, and nothing else
    assert g["modes"]["shiftable"]["samples_per_s"] == 20.0 and g["modes"]["colocated"]["samples_per_s"] == 10.0
    assert g["speedup_vs_colocated"] == pytest.approx(2.0)
    assert "shiftable again at" in (tmp_path / "new.md").read_text()
