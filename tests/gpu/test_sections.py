"""The GPU checks: every section of ``pivotrl.gpucheck`` on one CUDA GPU at its full size, its findings asserted.

Marked ``gpu`` and run by ``make gpu-check`` (``pytest -m gpu tests/gpu``), in the order a maintainer reads
them; skipped without CUDA, and a section whose packages this interpreter lacks (Ray, vLLM, orjson) is skipped
with the reason. The timings of the same sections are ``benchmarks/gpu_check.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pivotrl.gpucheck.machine import cuda_context, resolved
from pivotrl.gpucheck.models import engine_throughput, parity, vllm_backend
from pivotrl.gpucheck.sampling import sampling_check
from pivotrl.gpucheck.sections import cannot_run
from pivotrl.gpucheck.train import fsdp_check, job, vllm_job, zero_check
from pivotrl.gpucheck.transfer import gps_load, gps_load_ray, shifts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make gpu-check on a GPU machine)"),
]
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def fp32_matmuls() -> Iterator[None]:
    """An fp32 comparison means fp32 matmuls (no TF32); each section's cached device memory goes back after it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
    torch.cuda.empty_cache()


def needs(section: str) -> None:
    """Skip, saying why, where this interpreter lacks a package the section needs."""
    reason = cannot_run(section)
    if reason:
        pytest.skip(reason)


def test_parity_with_transformers_in_fp32_and_bf16() -> None:
    """Logits of our decoder against transformers on one random checkpoint: within 1e-3 in fp32; in bf16 our
    error against the fp32 reference at most 1.5x transformers' own; the KV-cached path beside the full forward."""
    needs("parity")
    r = parity(DEVICE)
    assert r["float32"]["pass"], r["float32"]
    assert r["float32"]["max_abs_vs_transformers"] <= 1e-3 and r["float32"]["cached_vs_full_max_abs"] <= 1e-3
    assert r["bfloat16"]["pass"], r["bfloat16"]
    assert r["bfloat16"]["ours_mean_abs_err"] <= 1.5 * r["bfloat16"]["transformers_mean_abs_err"] + 1e-4
    assert r["pass"]


def test_a_gps_version_loads_exactly_into_fp32_and_bf16_copies() -> None:
    needs("gps_load")
    r = gps_load(DEVICE)
    assert r["float32"]["correct"] and r["bfloat16"]["correct"], r
    assert r["pass"]


def test_a_gps_version_loads_exactly_from_rays_object_store() -> None:
    needs("gps_load_ray")
    r = gps_load_ray(DEVICE)
    assert r["float32"]["correct"] and r["bfloat16"]["correct"], r
    assert r["pass"]


def test_a_device_shifts_through_every_role_pair_of_a_step() -> None:
    needs("shifts")
    r = shifts(DEVICE)
    pairs = r["pairs"]
    expected = {"none->rollout", "rollout->judge", "judge->train", "train->rollout", "rollout->rollout"}
    assert expected | {"rollout->train", "train->judge", "judge->rollout"} == set(pairs)
    assert all(p["median_s"] > 0 for p in pairs.values()), pairs
    assert r["rollout_dtype"] == "bfloat16" and all(p["held_gb_after"] is not None for p in pairs.values())


def test_the_engine_generates_every_token_asked_for_beside_transformers() -> None:
    """(The section itself asserts that each generator wrote each request's own number of tokens.)"""
    needs("engine")
    r = engine_throughput(DEVICE)
    assert r["tokens"] > 0 and r["pivotrl"]["tokens_per_s"] > 0 and r["transformers"]["tokens_per_s"] > 0


def test_the_fsdp_trainer_updates_as_the_plain_one_and_shards_its_kl_reference() -> None:
    needs("fsdp")
    r = fsdp_check(DEVICE)
    assert r["fp32_max_abs_vs_plain"] < 1e-5, r
    assert r["ref_root_sharded"], r
    assert r["pass"]


def test_the_zero_trainer_updates_as_the_plain_one() -> None:
    needs("zero")
    r = zero_check(DEVICE)
    assert r["fp32_max_abs_vs_plain"] < 1e-5, r
    assert r["pass"]


def test_the_vllm_backend_swaps_sleeps_wakes_and_stays_alone_in_its_process() -> None:
    """Greedy output after a wake equals the same requests before the sleep; a second engine in the same process
    is refused in one line before vLLM's allocator asserts. (The section asserts that vLLM wrote each request's
    own number of tokens.)"""
    needs("vllm")
    r = vllm_backend(DEVICE)
    assert r["after_wake_equal"], r
    assert r["second_engine_refused"], r
    assert r["pass"]


def test_a_job_with_both_models_on_vllm_shifts_between_them_on_one_gpu(tmp_path) -> None:
    """Two devices on one GPU, policy and judge on vLLM: every engine in a process of its own, and devices shift
    between rollout and judge both ways, the engines asleep and woken, never rebuilt."""
    needs("vllm_job")
    r = vllm_job(DEVICE, tmp_path)
    assert r["pass"], r


def test_the_vllm_processor_draws_what_the_native_sampler_draws_without_waiting_on_the_gpu() -> None:
    """On the same logits, every kind of row mixed: the same tokens and log-probs; the hash's uniforms are the
    CPU's bit for bit; and the processor's step is timed beside vLLM's sampler (benchmarks/gpu_check.py)."""
    needs("sampling")
    r = sampling_check(DEVICE, batches=(64,), repeats=2)
    assert r["agreement"]["tokens_equal"] == 1.0 and r["agreement"]["logprob_max_abs_diff"] == 0.0, r
    assert r["uniforms_match_cpu"], r
    assert r["pass"]


def test_a_job_runs_every_step_with_its_devices_sharing_the_gpu(tmp_path) -> None:
    """``pivotrl train`` in a subprocess: four device actors on the GPU (without Ray, one device in process)."""
    needs("job")
    r = job(DEVICE, tmp_path)
    assert r["pass"], r.get("stderr_tail")
    assert r["returncode"] == 0 and r["steps"] == 10
    assert r["judge_dtype"] == ("bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16")


def test_the_default_job_serves_its_judge_in_bf16_where_the_gpu_computes_in_it() -> None:
    """judge.dtype=auto and policy.rollout_dtype=auto on this GPU: bf16 (compute capability 8.0 and above),
    else fp16, as vLLM's own auto; vLLM is the backend where it is installed, and no migration audit runs."""
    r = resolved()
    low = "bfloat16" if r["gpu_bf16"] else "float16"
    assert (r["judge_dtype"], r["rollout_dtype"], r["audit_migrations"]) == (low, low, False), r
    assert r["judge_backend"] == ("vllm" if cannot_run("vllm") is None else "native"), r


def test_one_more_process_takes_about_the_cuda_context_the_plan_counts() -> None:
    """The plan counts CUDA_CONTEXT_BYTES for each process a device keeps on its GPU (the trainer, each vLLM
    engine): a process holding torch, a tensor and a matmul takes of that order (the section reports the figure)."""
    r = cuda_context()
    assert 0.25 <= r["of_estimate"] <= 4.0, r
