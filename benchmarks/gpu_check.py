"""GPU timings: what a maintainer measures on any machine with one CUDA GPU (``make gpu-check``).

The correctness checks of the same sections are pytest tests (``tests/gpu``, marker ``gpu``: logits parity,
the engine's output, GPS loads, shifts, the trainers, vLLM, a shared-GPU job), run by ``make gpu-check``
before this. This script times the sections (``pivotrl.gpucheck``), each guarded (a failure is recorded,
the rest still run), within an eight-minute budget, prints a table and writes
``benchmarks/results/gpu_check.json``:

a. ``engine``: tokens/s of the native engine against ``transformers.generate``
   on a randomly initialised Qwen2-0.5B-shaped model in bf16: 256 requests of
   mixed prompt and response lengths, 64 at a time, greedy, the same requests
   to both (transformers runs them in static batches of 64 in the same order;
   only the tokens each request asked for are counted).
b. ``gps_load``: a version of about 2 GB (the 0.5B shape in fp32) brought onto
   the GPU by ``fetch`` + ``load_into`` from a LocalStore, into an fp32 copy
   (bytes straight into the parameters) and a bf16 copy (cast on the GPU),
   through the process's page-locked staging buffer (two 32 MB buckets, locked
   once), against a plain page-locked host-to-device copy of the same bytes:
   the physical limit, bytes / host-to-device bandwidth (ratio, GB/s); then the
   same version page-locked in place (``Snapshot.pin``, timed apart) and loaded
   from there. ``gps_load_ray``: the same from Ray's object store (shared
   memory mapped into this process; the store started here, preallocated).
c. ``shifts``: wall time of ``Worker.shift`` per role pair on device "cuda"
   with a LocalStore (0.5B-shaped policy and judge, rollout and judge in bf16),
   and the device memory held after each shift.
d. ``fsdp`` and ``zero``: a bf16 step of the 0.5B shape with activation
   checkpointing on one GPU (seconds, tokens/s, peak memory against the
   arithmetic of ``pivotrl.train.memory``).
e. ``vllm``: the vLLM backend's tokens/s beside the native engine on the engine
   section's requests, a version swapped in place from the GPS, sleep and wake
   (device memory freed, seconds). Skipped when vLLM is not installed.
f. ``member_lost``: two ranks of an NCCL train group, one per GPU, rank 1
   killed: rank 0's collective fails within seconds once the group is aborted,
   its process kept. Needs two GPUs (NCCL takes one rank per GPU); on one it
   says so.
g. ``sampling``: pivotrl's counter-based draw inside vLLM (the logits processor,
   run by vLLM's sampler as the backend runs it) against its element-wise form
   (``benchmarks/sampling_baseline.py``) and vLLM's own sampler at temperature
   1, with and without a seed per request: milliseconds per step at
   vocabulary 151,936, batch 64 and 256; the processor's tokens and log-probs
   against the native engine's sampler on the same logits (every kind of row
   mixed), and the uniforms' bits against the CPU's. Skipped without vLLM.
h. ``vllm_job``: two devices sharing the GPU with the policy and the judge on
   vLLM, shiftable, temperature 1: every engine in a process of its own, and
   shifts between rollout and judge both ways, at least twice each.
i. ``job``: ``pivotrl train examples/default.yaml steps=10 devices=4
   device=cuda gpus_per_device=0.25`` in a subprocess, four device actors
   sharing the GPU; with tiny random checkpoints and a small job when the
   bundled models are not built (``make prepare``), which the output says.
   It reports Ray's object store as the job configured it (bytes, preallocated
   or not, the GPS's peak it was sized for) and the GPS's bytes at the end.
   Where Ray is not installed, one device in the training process instead
   (``devices=1 mode=colocated``).

k. ``tensor_parallel``: instances of two GPUs (two instances on a machine of four
   GPUs or more, else one), whole GPUs per device, the policy and the judge on
   vLLM with tensor parallel over each instance's GPUs, shiftable: every step
   done and every engine rank a process of its own serving one model. Skipped,
   saying so, where the machine has one GPU.

j. ``cuda_context``: the device memory one more process takes for its CUDA
   context (a child process holding torch, a tensor and a matmul on the GPU),
   against the estimate the job's plan counts per process on a GPU
   (``pivotrl.resolve.CUDA_CONTEXT_BYTES``: a device's trainer and each of its
   vLLM engines), and the child's start time.

k. ``moe``: ``benchmarks/moe.py`` on the GPU in bf16: forward + backward of a
   Qwen3-30B-A3B-shaped sparse layer at 4,096 tokens, the grouped layer
   against the loop it replaced, side by side (seconds, ``speedup``, whether
   the grouped kernel ran, the two implementations' largest differences).

Before the sections it prints, and the report keeps (``resolved``), what the
default job resolves to on this GPU: the judge's and the rollout's dtypes,
the backends, the migration audit.

Without CUDA it prints one line and exits 0; where ``nvidia-smi`` lists GPUs
that torch does not see, it says so in one line and exits 1 (unless
``CUDA_VISIBLE_DEVICES`` hides them on purpose: "" or -1). Nothing is
downloaded.

    .venv/bin/python benchmarks/gpu_check.py                 # everything
    .venv/bin/python benchmarks/gpu_check.py --only gps_load,shifts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe import run as moe_layer
from sampling_baseline import processor_class as element_wise_processor

from pivotrl.gpucheck.machine import cuda_context, resolved, unseen_gpus
from pivotrl.gpucheck.models import engine_throughput, parity, vllm_backend
from pivotrl.gpucheck.sampling import processor_step, sampling_check
from pivotrl.gpucheck.sections import cannot_run, headline, run_section
from pivotrl.gpucheck.shapes import gb
from pivotrl.gpucheck.train import fsdp_check, job, member_lost, tensor_parallel_job, vllm_job, zero_check
from pivotrl.gpucheck.transfer import gps_load, gps_load_ray, shifts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
BUDGET_S = 8 * 60
NATIVE = ("rollout.backend=native", "judge.backend=native")  # the job section's backends (vllm_job runs vLLM's)


def element_wise(batch: int, device: str) -> Callable[[Any], Any]:
    """A step of the element-wise processor, the sampling section's baseline."""
    return processor_step(element_wise_processor(), batch, device)


def print_table(sections: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'section':<13} {'status':<8} {'s':>6}  result")
    for name, s in sections.items():
        print(f"{name:<13} {s['status']:<8} {s.get('seconds', 0):>6.1f}  {headline(name, s)[:300]}")


def machine() -> dict[str, Any]:
    import platform

    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gb": gb(props.total_memory),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


# in the order they run: what a first GPU run most needs to see first (an 8-minute budget skips the last ones
# when the machine is slow, saying so)
SECTIONS = (
    "parity", "cuda_context", "vllm", "vllm_job", "sampling", "gps_load", "gps_load_ray", "shifts", "fsdp", "zero",
    "moe", "engine", "member_lost", "tensor_parallel", "job",
)  # fmt: skip


ESTIMATE_S = {
    "parity": 30, "gps_load": 40, "gps_load_ray": 60, "shifts": 60, "engine": 90, "fsdp": 60, "zero": 40, "vllm": 120,
    "member_lost": 30, "cuda_context": 20, "sampling": 30, "vllm_job": 180, "job": 120, "moe": 30,
    "tensor_parallel": 150,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON report")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; allowed: {', '.join(SECTIONS)}")

    import torch

    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        unseen = unseen_gpus(False, f"{torch.__version__}, {built}")
        if unseen:
            print(unseen)
            return 1
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, {built}); nothing to check")
        return 0

    start = time.perf_counter()
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 sections compare fp32 matmuls
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "parity": lambda: parity(device),
        "gps_load": lambda: gps_load(device),
        "gps_load_ray": lambda: gps_load_ray(device),
        "shifts": lambda: shifts(device),
        "engine": lambda: engine_throughput(device),
        "fsdp": lambda: fsdp_check(device),
        "zero": lambda: zero_check(device),
        "moe": lambda: moe_layer(device, tokens=4096, reps=3),
        "member_lost": lambda: member_lost(device),
        "vllm": lambda: vllm_backend(device),
        "cuda_context": cuda_context,
        "sampling": lambda: sampling_check(device, others={"element-wise processor": element_wise}),
    }
    sections: dict[str, dict[str, Any]] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plan = resolved()  # (what the default job serves with on this GPU: the judge's dtype first)
    print(
        f"gpu-check: {plan['config']} resolves here to judge.dtype={plan['judge_dtype']} (asked: "
        f"{plan['asked']['judge.dtype']}), rollout dtype {plan['rollout_dtype']}, backends rollout "
        f"{plan['rollout_backend']} and judge {plan['judge_backend']}, migration audit "
        f"{'on' if plan['audit_migrations'] else 'off'}",
        flush=True,
    )

    def write(done: bool) -> float:
        """The report so far: written after every section too, so that a native crash (NCCL, an allocator's
        teardown) in a later one loses none of those before it."""
        total = time.perf_counter() - start
        report = {"machine": machine(), "total_seconds": round(total, 1), "complete": done, "resolved": plan,
                  "sections": sections}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        return total

    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            left = BUDGET_S - (time.perf_counter() - start)
            if name == "job":
                fn: Callable[[], dict[str, Any]] = lambda left=left: job(
                    device, Path(tmp), max(30.0, left - 20), extra=NATIVE
                )
            elif name == "vllm_job":  # (leaves the last job its time)
                fn = lambda left=left: vllm_job(device, Path(tmp) / "vllm", max(30.0, min(240.0, left - 140)))
            elif name == "tensor_parallel":
                if torch.cuda.device_count() < 2:
                    why = f"{torch.cuda.device_count()} GPU here: instances of several GPUs need 2 or more"
                    sections[name] = {"status": "skipped", "reason": why}
                    continue
                fn = lambda left=left: tensor_parallel_job(
                    device, Path(tmp) / "tp", torch.cuda.device_count(), max(30.0, min(240.0, left - 120))
                )
            else:
                fn = jobs[name]
            if left < ESTIMATE_S[name] / 2:
                sections[name] = {"status": "skipped", "reason": f"{left:.0f} s of the 8-minute budget left"}
                continue
            reason = cannot_run(name)
            if reason:
                sections[name] = {"status": "skipped", "reason": reason}
                continue
            print(f"gpu-check: {name} ...", flush=True)
            sections[name] = run_section(name, fn)
            torch.cuda.empty_cache()
            write(done=False)
    print_table(sections)
    total = write(done=True)
    print(f"wrote {args.out} ({total:.0f} s)")
    return 1 if any(s["status"] == "failed" for s in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
