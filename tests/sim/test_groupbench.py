"""A model group in every mode: the runs it asks for, and a report's other modes kept when some run again."""

from __future__ import annotations

import pytest

from pivotrl.sim.groupbench import Settings, bench
from pivotrl.sim.groupreport import update_note
from pivotrl.sim.groups import GROUPS, job_overrides
from pivotrl.sim.steady import ROLES

OLD_MODES = ("colocated", "disaggregated", "shiftable")  # reports before the deployed baseline


def kept_group() -> dict:
    """A group of an earlier report run at 32 GPUs, its ideal left out as an older report might have it."""
    modes = {m: {"samples_per_s": rate, "step_seconds": 8192 / rate, "busy_fraction": dict.fromkeys(
        (*ROLES, "shift"), 0.2), "idle_fraction": 0.2, "shifts_per_step": 1.0, "moves_per_step": 1.0,
        "shift_seconds_per_step": 1.0} for m, rate in zip(OLD_MODES, (10.0, 8.0, 12.0), strict=True)}  # fmt: skip
    overrides = job_overrides(GROUPS["dense-7b"], 32, 1)
    return {"name": "dense-7b", "what": "dense pair", "policy": "Qwen2.5-7B", "judge": "Qwen2.5-7B", "gpus": 32,
            "instance_gpus": 1, "devices": 32, "overrides": overrides, "ideal": {}, "modes": modes}  # fmt: skip


def test_an_update_runs_only_the_modes_named_and_keeps_the_others():
    ran = []

    def fake_simulate(config, overrides, timeout, keep=None):
        assert config == GROUPS["dense-7b"].config and keep is None
        mode = next(x.split("=")[1] for x in overrides if x.startswith("mode="))
        ran.append(mode)
        return {"wall_s": 1.0, "samples_per_s": 20.0, "step_seconds": 8192 / 20.0, "rollout_seconds": 300.0,
                "busy_fraction": dict.fromkeys((*ROLES, "shift"), 0.2), "idle_fraction": 0.2,
                "shifts_per_step": 1.0, "moves_per_step": 1.0, "shift_seconds_per_step": 1.0}  # fmt: skip

    said: list[str] = []
    g = bench(GROUPS["dense-7b"], 32, Settings(), ["shiftable"], kept=kept_group(), simulate=fake_simulate,
              say=said.append)  # fmt: skip
    assert set(ran) == {"shiftable"}  # at each instance size tried, and nothing else
    assert g["modes"]["shiftable"]["samples_per_s"] == 20.0 and g["modes"]["colocated"]["samples_per_s"] == 10.0
    assert g["speedup_vs_colocated"] == pytest.approx(2.0)
    assert any(line.startswith("  shiftable TP") for line in said)
    report = {"code": "abc", "wall_s": 60.0, "groups": [g], "updates": [{"code": "def", "modes": ["shiftable"]}]}
    assert "shiftable again at def" in update_note(report)


def test_every_mode_runs_the_groups_job_and_the_split_is_searched_then_run_at_full_length():
    runs = []

    def fake_simulate(config, overrides, timeout, keep=None):
        runs.append(overrides)
        steps = int(next(x.split("=")[1] for x in overrides if x.startswith("steps=")))
        return {"wall_s": 1.0, "samples_per_s": 10.0, "step_seconds": 819.2 + steps}

    settings = Settings(steps=5, search_steps=3, search_budget=4, tp=4)
    g = bench(GROUPS["dense-7b"], 32, settings, simulate=fake_simulate, say=lambda _: None)
    assert list(g["modes"]) == ["deployed", "colocated", "disaggregated", "shiftable"]
    assert all(r[:3] == job_overrides(GROUPS["dense-7b"], 32, 4) for r in runs)
    search = [r for r in runs if "steps=3" in r]
    assert len(search) == 4 and all("mode=disaggregated" in r for r in search)  # (the search's budget)
    dis = g["modes"]["disaggregated"]
    assert dis["instance_gpus"] == 4 and len(dis["search"]) == 4 and f"split={dis['split']}" in runs[-1]
    assert "steps=5" in runs[-1] and g["config"] == str(GROUPS["dense-7b"].config)
