"""The engine layouts: the jobs they name and how each mode's rows are picked."""

from __future__ import annotations

import pytest

from pivotrl.control.messages import Role
from pivotrl.errors import UserError
from pivotrl.sim.engine_layouts import overrides, rows, summarize
from pivotrl.sim.groups import GROUPS
from pivotrl.sim.run import build


def test_each_layout_is_a_job_the_simulator_builds():
    cases = (("judge-32b", (4, 2, 4), False, (2, 1)), ("judge-32b", (4, 4, 4), False, (1, 1)),
             ("dense-14b", (8, 0, 0), True, (8, 8)))  # fmt: skip
    for name, layout, elastic, engines in cases:
        spec = build(GROUPS[name].job(overrides(GROUPS[name], 128, layout, elastic))).spec
        assert spec.tp == layout[0] and spec.elastic is elastic
        # elastic: the smallest engines that hold each model with its longest sequence (both on 1 GPU)
        assert (spec.engines(Role.ROLLOUT), spec.engines(Role.JUDGE)) == engines
    # instances of 8 GPUs are no layout for a 7B policy: its 28 attention heads cannot be cut in 8
    with pytest.raises(UserError, match="tensor_parallel=8: the policy's num_attention_heads=28 cannot be cut"):
        build(GROUPS["judge-32b"].job(overrides(GROUPS["judge-32b"], 128, (8, 0, 0), True)))


def run(layout: str, rate: float, elastic: bool = False) -> dict:
    return {"layout": layout, "samples_per_s": rate, "elastic": elastic}


def test_summary_compares_each_modes_best_layout_with_its_best_single_engine():
    runs = {
        "colocated": [run("TP4 r4 j4", 80.0), run("TP4 r4 j2", 82.0), run("TP8 elastic", 90.0, True)],
        "disaggregated": [run("TP2 r2 j2", 60.0), run("TP4 r4 j4", 55.0), run("TP4 r2 j4", 58.0),
                          {"layout": "TP4 r4 j2", "elastic": False, "error": "failed"}],
        "shiftable": [run("TP4 r4 j4", 100.0), run("TP4 r2 j4", 95.0), run("TP8 elastic", 99.0, True)],
    }  # fmt: skip
    s = summarize(runs)
    colocated = {"one_engine": 80.0, "one_engine_layout": "TP4 r4 j4", "best": 82.0, "best_layout": "TP4 r4 j2",
                 "elastic": 90.0, "elastic_layout": "TP8 elastic"}  # fmt: skip
    assert s["modes"]["colocated"] == colocated
    assert s["modes"]["disaggregated"]["one_engine"] == 60.0 and s["modes"]["disaggregated"]["elastic"] is None
    assert s["speedup_vs_colocated"] == pytest.approx(100 / 82)
    assert s["speedup_vs_disaggregated"] == pytest.approx(100 / 60)
    # the elastic ratio takes each mode's better of its bound and its best layout
    assert s["elastic_speedup_vs_colocated"] == pytest.approx(100 / 90)
    assert s["elastic_speedup_vs_disaggregated"] == pytest.approx(100 / 60)
    table = rows({"name": "g", **s})
    assert table[0] == ["g", "colocated", "80.0", "TP4 r4 j2", "82.0", "+2.5%", "90.0", "+12.5%"]
    assert table[1][-2:] == ["-", "-"]
