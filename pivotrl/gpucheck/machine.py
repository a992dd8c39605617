"""What a GPU check learns of the machine before it checks anything: whether torch sees the GPUs the machine
has, what the job resolves to on them (``pivotrl.resolve``), and what one more process's CUDA context takes.

A machine whose driver lists GPUs that torch cannot use (a CPU build of torch, a CUDA build older than the
driver allows, a ``CUDA_VISIBLE_DEVICES`` naming no GPU) is a failed check, not a machine without GPUs: the
check says so in one line and exits non-zero.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pivotrl.gpucheck.shapes import gb

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JOB = ROOT / "examples" / "default.yaml"


def listed_gpus(timeout_s: float = 20.0) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (its ``GPU i: name (UUID: ...)`` lines); none where it is not on PATH,
    fails or hangs (no driver: nothing to compare torch with)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return []
    if proc.returncode != 0:
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.startswith("GPU ")]


def hidden_on_purpose() -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to hide every GPU ("" or -1), as a CPU-only run asks: torch seeing none is
    what was asked for then."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def unseen_gpus(torch_sees_cuda: bool, torch_build: str) -> str | None:
    """The line a check fails with where the driver lists GPUs that torch does not see (None: nothing amiss).
    ``torch_build``: how torch was built, for the line (its version and CUDA or CPU-only)."""
    if torch_sees_cuda or hidden_on_purpose():
        return None
    listed = listed_gpus()
    if not listed:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (
        f"gpu-check: nvidia-smi lists {len(listed)} GPU(s) ({listed[0]}) but torch ({torch_build}) sees no CUDA "
        f"device{where}: install a CUDA build of torch the driver supports, or correct CUDA_VISIBLE_DEVICES"
    )


def resolved(config: Path = DEFAULT_JOB) -> dict[str, Any]:
    """The job of ``config`` resolved on this process's GPU, as a run here resolves it (one device a GPU): the
    dtypes the policy's rollout copy and the judge are served in, the backends, the migration audit."""
    import torch

    from pivotrl.config import load_config
    from pivotrl.engine.vllm_engine import available as vllm_available
    from pivotrl.resolve import Hardware, resolve

    cfg = load_config(config)
    total = torch.cuda.get_device_properties(0).total_memory
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    plan = resolve(cfg, Hardware.of(cfg, "cuda", total, bf16=bf16, vllm=vllm_available()))
    return {"config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
            "asked": {"judge.dtype": cfg.judge.dtype, "policy.rollout_dtype": cfg.policy.rollout_dtype},
            "gpu_bf16": bf16, **plan.serving()}  # fmt: skip


# a process that holds a CUDA context as an engine's or a trainer's does (torch loaded, a tensor and a matmul on
# the device), says so, and keeps it until its stdin closes
_HOLDER = (
    "import sys, torch; x = torch.ones(64, 64, device='cuda'); (x @ x).sum().item(); "
    "print('ready', flush=True); sys.stdin.read()"
)


def cuda_context(timeout_s: float = 120.0) -> dict[str, Any]:
    """The device memory one more process takes for its CUDA context: the GPU's free memory before and while a
    child process holds one, against the estimate the plan counts per process (``CUDA_CONTEXT_BYTES``)."""
    import torch

    from pivotrl.resolve import CUDA_CONTEXT_BYTES

    torch.cuda.synchronize()
    before, _ = torch.cuda.mem_get_info()
    child = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.perf_counter()
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the child process did not start a CUDA context (exit {child.wait(timeout_s)})")
        start_s = time.perf_counter() - t0
        held, _ = torch.cuda.mem_get_info()
        child.stdin.close()
        child.wait(timeout_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    used = before - held
    return {
        "context_gb": gb(used),
        "estimate_gb": gb(CUDA_CONTEXT_BYTES),
        "of_estimate": round(used / CUDA_CONTEXT_BYTES, 2),
        "process_start_s": round(start_s, 2),
    }
