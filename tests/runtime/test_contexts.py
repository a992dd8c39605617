"""A generation context's KV budget on a GPU, with torch's CUDA memory queries faked on this CPU."""

from __future__ import annotations

import torch

from pivotrl.engine import vllm_engine
from pivotrl.engine.kv_budget import AUTO_FRACTION
from pivotrl.runtime.contexts import ContextSpec, kv_budget

GIB = 1 << 30


def fake_gpu(monkeypatch, free: int, total: int, allocated: int, asleep: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(vllm_engine, "asleep_bytes", lambda: asleep)


def test_a_sleeping_vllm_engine_of_the_other_model_does_not_shrink_the_budget(monkeypatch):
    # 80 GiB: this context's weights (15) mapped, the judge's vLLM engine (60: weights and cache) asleep, unmapped
    # but still counted allocated by torch
    fake_gpu(monkeypatch, free=65 * GIB, total=80 * GIB, allocated=75 * GIB, asleep=60 * GIB)
    budget = kv_budget(ContextSpec(device="cuda"), torch.device("cuda"), 15 * GIB)
    assert budget.nbytes == int(AUTO_FRACTION * 65 * GIB)


def test_what_the_device_holds_mapped_still_counts(monkeypatch):
    fake_gpu(monkeypatch, free=65 * GIB, total=80 * GIB, allocated=15 * GIB, asleep=0)
    half = kv_budget(ContextSpec(device="cuda", memory_share=0.5), torch.device("cuda"), 15 * GIB)
    assert half.nbytes == int(AUTO_FRACTION * 25 * GIB)  # its half of the GPU, less its weights


def test_no_sleeping_engine_where_vllm_built_none():
    assert vllm_engine.asleep_bytes() == 0
