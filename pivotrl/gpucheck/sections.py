"""What a GPU check's driver shares with its tests: a section run guarded, the line of numbers it reports, and
why a section cannot run with this interpreter's packages."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any

NOT_RUN = "not run"


def run_section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One section, guarded: its result, or what went wrong; never an exception."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except NotImplementedError as e:
        return {"status": NOT_RUN, "reason": str(e), "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # a failed section is a finding; the others still run
        return {
            "status": "failed",
            "error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
            "seconds": round(time.perf_counter() - t0, 1),
        }
    status = "ok" if result.get("pass", True) else "failed"
    return {"status": status, "result": result, "seconds": round(time.perf_counter() - t0, 1)}


def headline(name: str, section: dict[str, Any]) -> str:
    """The one line of numbers the table shows for a section."""
    r = section.get("result")
    if r is None:
        return section.get("error") or section.get("reason") or ""
    if name == "engine":
        return (
            f"pivotrl {r['pivotrl']['tokens_per_s']:.0f} tok/s vs transformers {r['transformers']['tokens_per_s']:.0f}"
            f" ({r['speedup']:.2f}x), greedy agreement {r['greedy_agreement']:.2f}"
        )
    if name.startswith("gps_load"):
        plain = r.get("plain_copy", {}).get("pinned", {}).get("gb_per_s")
        head = f"{r['version_gb']} GB staged: fp32 {r['float32']['gb_per_s']} GB/s"
        head += f", bf16 {r['bfloat16']['gb_per_s']} GB/s; in place {r['in_place']['gb_per_s']} GB/s"
        head += f" after a {r['pin_seconds']} s pin"
        return head + (f"; plain pinned {plain} GB/s (ratio {r['ratio_fp32']}, {r['ratio_bf16']})" if plain else "")
    if name == "shifts":
        return ", ".join(f"{k} {v['median_s']:.3f}s" for k, v in r["pairs"].items())
    if name == "fsdp":
        return (
            f"fp32 vs plain max|d| {r['fp32_max_abs_vs_plain']:.1e}; bf16 step {r['bf16_step_seconds']} s, "
            f"{r['tokens_per_s']} tok/s, peak {r['peak_memory_gb']} GB (arithmetic {r['predicted_memory_gb']}); "
            f"retired {r['held_before_retire_gb']} -> {r['left_after_retire_gb']} GB; KL reference root sharded "
            f"{r['ref_root_sharded']}"
        )
    if name == "zero":
        return (
            f"fp32 vs plain max|d| {r['fp32_max_abs_vs_plain']:.1e}; bf16 backward {r['bf16_backward_seconds']} s "
            f"({r['tokens_per_s']} tok/s), optimizer step {r['optimizer_step_seconds']} s, "
            f"peak {r['peak_memory_gb']} GB (arithmetic {r['predicted_memory_gb']})"
        )
    if name == "vllm":
        return (
            f"{r['tokens_per_s']:.0f} tok/s vs native {r['native_tokens_per_s']:.0f}; greedy agreement "
            f"{r['greedy_agreement_v0']:.2f} (v1 {r['greedy_agreement_v1']:.2f}); swap {r['swap_seconds']} s, "
            f"sleep {r['sleep_seconds']} s freed {r['freed_gb']} GB, wake+load {r['wake_seconds']} s; a second engine "
            f"in its process refused: {r['second_engine_refused']}"
        )
    if name == "moe":
        v, d = r["variants"], r["max_abs_diff_loop_vs_grouped"]
        return (
            f"{r['tokens']} tokens fwd+bwd in {r['dtype']}: grouped {v['grouped']['median_s']:.4f} s vs loop "
            f"{v['loop']['median_s']:.4f} s ({r['speedup']:.2f}x; grouped kernel {r['grouped_kernel']}), dense floor "
            f"{v['dense floor']['median_s']:.4f} s; loop vs grouped max|d| output {d['output']:.1e}"
        )
    if name == "member_lost":
        return f"rank 0's collective failed {r.get('after_loss_s')} s after rank 1 died, its process kept: {r['pass']}"
    if name == "vllm_job":
        return (
            f"{r.get('steps')} steps in {r['seconds']} s; shifts {r.get('shifts_by_pair')}; "
            f"{r.get('engine_processes')} engine processes, each one model's: {r.get('engines_alone')}"
        )
    if name == "tensor_parallel":
        return (
            f"{r.get('instances')} instance(s) of 2 GPUs, {r.get('steps')} steps in {r['seconds']} s; shifts "
            f"{r.get('shifts_by_pair')}; {r.get('engine_processes')} engine processes, each one model's: "
            f"{r.get('engines_alone')}"
        )
    if name == "cuda_context":
        return (
            f"one more process's CUDA context {r['context_gb']} GB ({r['of_estimate']}x the plan's estimate of "
            f"{r['estimate_gb']} GB), started in {r['process_start_s']} s"
        )
    if name == "sampling":
        a = r["agreement"]
        times = "; ".join(
            f"batch {b}: " + ", ".join(f"{k} {v['ms']:.3g}" for k, v in row.items() if k != "processor_over_vllm")
            for b, row in r["batches"].items()
        )
        return (f"ms a step at vocab {r['vocab']}: {times}; processor = native sampler on {a['rows']} rows: tokens "
                f"{a['tokens_equal']:.2f}, log-probs max|d| {a['logprob_max_abs_diff']:.1e}; uniforms = CPU's "
                f"{r['uniforms_match_cpu']}")  # fmt: skip
    if name == "job":
        where = "4 Ray devices" if r.get("ray", True) else "1 device in process (no Ray)"
        from pivotrl.gps_sizing import size

        store, held = r.get("object_store"), ""
        if store:  # (a Ray run)
            held = f"; object store {size(store['bytes'])}{', preallocated' if store['preallocated'] else ''}"
            held += f" for a GPS of up to {size(store['gps_bytes'])}"
        return (f"{r.get('steps')} steps on {where} in {r['seconds']} s, {r.get('samples_per_s')} samples/s, judge "
                f"in {r.get('judge_dtype')}; GPS {size(r.get('gps_bytes', 0))} at the end{held}; "
                f"models: {r['models']}")  # fmt: skip
    return json.dumps(r)[:200]


# packages a section needs beyond torch, transformers and the rest every section imports (the job runs one
# device in process without Ray; the device actors' runtime and the run files it writes need orjson)
NEEDS = {
    "parity": ("transformers",),
    "engine": ("transformers",),
    "gps_load_ray": ("ray", "orjson"),
    "shifts": ("orjson",),
    "job": ("orjson", "yaml", "jinja2", "tqdm", "matplotlib"),  # (the run's config, chat template, bar, timeline)
    "vllm_job": ("ray", "orjson", "yaml", "jinja2", "tqdm", "matplotlib"),
    "tensor_parallel": ("ray", "orjson", "yaml", "jinja2", "tqdm", "matplotlib"),
}
PACKAGES = {"ray": "Ray", "orjson": "orjson", "transformers": "transformers", "yaml": "PyYAML", "jinja2": "Jinja2",
            "tqdm": "tqdm", "matplotlib": "matplotlib"}  # fmt: skip


def cannot_run(name: str) -> str | None:
    """Why section ``name`` cannot run with this interpreter's packages (None: it can): a GPU machine whose
    python3 holds a CUDA build of torch but cannot install more (``make gpu-check-system``) may lack Ray, vLLM
    or orjson."""
    import importlib.util

    if name == "member_lost":
        import torch

        if torch.cuda.device_count() < 2:
            return (
                f'NCCL takes one rank per GPU (two ranks on one GPU fail when the communicator is made: "Duplicate '
                f'GPU detected"), and this machine has {torch.cuda.device_count()}'
            )
    if name in ("vllm", "sampling", "vllm_job", "tensor_parallel"):
        try:
            from pivotrl.engine.vllm_engine import available as vllm_available
        except ImportError as e:  # (a package the backend's module needs)
            return f"the vLLM backend cannot be imported ({e})"
        if not vllm_available():
            return "vLLM is not installed (make install adds it)"
    missing = [PACKAGES[m] for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed (make install adds it)"
