"""What follows from a model group's runs and its ideal: shares of the ideal and the floor, speedups, bounds."""

from __future__ import annotations

import pytest

from pivotrl.sim import groupreport
from pivotrl.sim.versus import LABELS
from pivotrl.sim.versus import SYNC_MODES as MODES  # (the paper table's: the on-policy modes)


def test_spent_splits_a_modes_time_into_the_work_and_what_is_beyond_it():
    busy = {"rollout": 0.5, "judge": 0.2, "train": 0.15, "shift": 0.05}
    g = {
        "ideal": {"gpu_seconds_by_role": {"rollout": 2.0, "judge": 1.0, "train": 1.0}},
        "ideal_fraction": {"colocated": 0.4},
        "modes": {"colocated": {"busy_fraction": busy, "idle_fraction": 0.1}, "shiftable": {"error": "timeout"}},
    }
    x = groupreport.spent(g, "colocated")
    # the ideal's work is 40% of the time: rollout 20%, judge 10%, train 10%; the rest of each role's busy is beyond
    assert x == pytest.approx({"work": 0.4, "rollout": 0.3, "judge": 0.1, "train": 0.05, "shift": 0.05, "idle": 0.1})
    assert sum(x.values()) == pytest.approx(1.0)
    assert groupreport.spent(g, "shiftable") is None


def fake_ideal(floor_rate: float, samples_per_s: float = 200.0) -> dict[str, float]:
    """An ideal of 8192 samples a step whose floor allows ``floor_rate`` samples/s."""
    return {"samples_per_s": samples_per_s, "step_seconds": 8192 / samples_per_s, "floor_seconds": 8192 / floor_rate}


def test_the_bound_is_the_best_floor_over_the_sizes_and_spent_uses_each_modes_own_ideal():
    busy = {"rollout": 0.5, "judge": 0.2, "train": 0.15, "shift": 0.05}
    at2 = {**fake_ideal(100.0, 200.0), "gpu_seconds_by_role": {"rollout": 2.0, "judge": 1.0, "train": 1.0}}
    at4 = {**fake_ideal(120.0, 160.0), "gpu_seconds_by_role": {"rollout": 1.0, "judge": 1.0, "train": 2.0}}
    g = {"instance_gpus": 2, "ideal": at2, "ideals": {"2": at2, "4": at4},
         "modes": {m: {"samples_per_s": 80.0, "busy_fraction": busy, "idle_fraction": 0.1, "instance_gpus": 4,
                       "step_seconds": 102.4, "shifts_per_step": 1.0, "moves_per_step": 1.0,
                       "shift_seconds_per_step": 1.0} for m in MODES}}  # fmt: skip
    g["modes"]["deployed"]["samples_per_s"] = 40.0
    g = groupreport.derive(g)
    assert groupreport.bound(g) == pytest.approx(120.0) and groupreport.bound_tp(g) == "4"
    # each mode over the floor's throughput; shiftable over the colocated baseline users run
    assert g["floor_fraction"] == pytest.approx({"deployed": 40 / 120, "colocated": 80 / 120,
                                                 "disaggregated": 80 / 120, "shiftable": 80 / 120})  # fmt: skip
    assert g["speedup_vs_deployed_colocated"] == pytest.approx(2.0)
    assert g["bound_vs_deployed_colocated"] == pytest.approx(3.0)
    assert [LABELS[m] for m in groupreport.modes_of(g)] == ["colocated, deployed", "colocated, strong",
                                                            "disaggregated", "shiftable"]  # fmt: skip
    assert g["ideal_fraction"]["shiftable"] == pytest.approx(80.0 / 200.0)  # of the highest ideal
    x = groupreport.spent(g, "colocated")  # at TP4: the work is half of the time, a quarter of it rollout
    want = {"work": 0.5, "rollout": 0.375, "judge": 0.075, "train": -0.1, "shift": 0.05, "idle": 0.1}
    assert x == pytest.approx(want) and groupreport.mode_tp(g, "colocated") == 4
    assert (
        "lockstep_bound" not in g and groupreport.lockstep_text(g) == ""
    )  # (a trainer that backpropagates when judged)


def test_a_trainer_that_backpropagates_at_the_step_is_held_to_its_own_floor():
    # FSDP2's floor at each size: 8192 samples in 102.4 s at TP2 (80/s), 81.92 s at TP4 (100/s)
    at2 = {**fake_ideal(100.0, 200.0), "lockstep_floor_s": 102.4}
    at4 = {**fake_ideal(120.0, 160.0), "lockstep_floor_s": 81.92}
    g = {"instance_gpus": 4, "ideal": at4, "ideals": {"2": at2, "4": at4},
         "modes": {m: {"samples_per_s": 90.0} for m in MODES}}  # fmt: skip
    g = groupreport.derive(g)
    assert groupreport.lockstep_bound(g) == pytest.approx(100.0) == g["lockstep_bound"]
    assert g["lockstep_of_floor"] == pytest.approx(100.0 / 120.0)  # no schedule of it reaches the floor
    assert g["lockstep_floor_fraction"]["shiftable"] == pytest.approx(0.9)
    assert g["floor_fraction"]["shiftable"] == pytest.approx(0.75)  # (the joint floor's fraction as before)
    text = groupreport.lockstep_text(g)
    assert "shorter than 82 s (TP4)" in text and "83% of the floor" in text and "shiftable at 90%" in text


def test_gap_says_when_shiftables_rollout_ends_and_how_long_after_it_the_update_comes():
    i = {**fake_ideal(100.0), "spread_rollout_s": 55.0, "after_s": 8.0}
    run = {"samples_per_s": 90.0, "step_seconds": 81.0, "rollout_seconds": 64.0, "instance_gpus": 4,
           "shift_seconds_per_step": 64.0}  # fmt: skip
    g = {"gpus": 128, "ideals": {"4": i}, "modes": {"shiftable": run}}
    line = groupreport.gap(g)
    assert "rollout ends at 64.0 s (spread path 55.0 s)" in line and "17.0 s later (the joint floor's 8.0 s)" in line
    assert "shifts 2.0 s a device" in line  # 64 device-seconds over 32 instances of 4 GPUs
    assert "judge" not in line  # (a report without the judge's busy time)
    # the judge busy a fifth of the step, against the floor's 640 + 1920 GPU-seconds of its work on 128 GPUs
    busy = {**run, "busy_fraction": {"rollout": 0.5, "judge": 0.2, "train": 0.2, "shift": 0.0}, "idle_fraction": 0.1}
    priced = {**i, "gpu_seconds": {"judge_prefill": 640.0, "judge_decode": 1920.0}}
    line = groupreport.gap({**g, "ideals": {"4": priced}, "modes": {"shiftable": busy}})
    assert "the judge keeps it 16.2 s against the floor's 20.0 s, and it idles 8.1 s" in line
    assert "waits" not in line  # (a run without group waits)
    waits = {**busy, "group_wait_s": {"median": 12.5, "p90": 20.0, "max": 30.0}}
    line = groupreport.gap({**g, "ideals": {"4": priced}, "modes": {"shiftable": waits}})
    assert "a group waits 12.5 s for its judgments (median)" in line
    assert groupreport.gap({**g, "ideals": {"4": fake_ideal(100.0)}}) is None  # an older report


def test_runs_at_a_size_the_runtime_builds_no_layout_at_are_dropped_and_said():
    """A report made before the layout rules: its runs at such a size leave its tried sizes, its split search and
    its ideals, and the notes say why; a mode chosen at such a size cannot be kept."""
    at4, at8 = fake_ideal(100.0), fake_ideal(90.0)
    g = {"name": "dense-7b", "ideals": {"4": at4, "8": at8},
         "modes": {"colocated": {"instance_gpus": 4, "sizes": [{"tp": 4, "samples_per_s": 80.0},
                                                              {"tp": 8, "samples_per_s": 60.0}]},
                   "disaggregated": {"instance_gpus": 4, "search": [{"tp": 4, "split": "a"}, {"tp": 8, "split": "b"}],
                                     "sizes": [{"tp": 4, "samples_per_s": 50.0}]}}}  # fmt: skip
    why = {"8": "tensor_parallel=8: the policy's num_attention_heads=28 cannot be cut in 8 parts"}
    out = groupreport.drop_unbuilt(g, why)
    assert out["ideals"] == {"4": at4} and out["unbuilt"] == why
    assert [t["tp"] for t in out["modes"]["colocated"]["sizes"]] == [4]
    assert [t["tp"] for t in out["modes"]["disaggregated"]["search"]] == [4]
    assert groupreport.unbuilt_notes([out], "name") == [
        "dense-7b: TP8 not run, no layout the runtime builds (tensor_parallel=8: the policy's "
        "num_attention_heads=28 cannot be cut in 8 parts)"
    ]
    chosen = {"name": "x", "ideals": {"8": at8}, "modes": {"shiftable": {"instance_gpus": 8}}}
    with pytest.raises(groupreport.Unbuilt, match="x shiftable ran at TP8, no layout the runtime builds"):
        groupreport.drop_unbuilt(chosen, why)
