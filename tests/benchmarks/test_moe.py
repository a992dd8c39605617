"""``benchmarks/moe.py`` at a small shape: every variant timed, the two implementations compared, the GPU check's
line for it."""

from __future__ import annotations

import json

from benchmarks.moe import Shape, main, run, table
from pivotrl.gpucheck.sections import headline

SMALL = Shape(experts=6, top_k=2, hidden=32, width=16)


def test_the_grouped_layer_and_the_loop_are_timed_side_by_side_on_the_same_inputs():
    r = run("cpu", tokens=5, reps=2, shape=SMALL)
    assert set(r["variants"]) == {"loop", "grouped", "chosen loop", "dense floor"}
    assert all(len(v["seconds"]) == 2 and v["median_s"] > 0 for v in r["variants"].values())
    assert r["speedup"] == round(r["variants"]["loop"]["median_s"] / r["variants"]["grouped"]["median_s"], 3)
    assert r["grouped_kernel"] and r["dtype"] in ("float32", "bfloat16") and r["dtype_reason"]
    diffs = r["max_abs_diff_loop_vs_grouped"]
    assert set(diffs) == {"output", "input_grad", "router_grad", "expert_grads"}
    assert max(diffs.values()) < (1e-4 if r["dtype"] == "float32" else 1e-1)
    assert "vs loop" in table(r) and "grouped" in headline("moe", {"result": r})


def test_the_report_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.moe.Shape", lambda: SMALL)
    out = tmp_path / "moe.json"
    assert main(["--tokens", "4", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"] == {"experts": 6, "top_k": 2, "hidden": 32, "width": 16} and report["speedup"] > 0
