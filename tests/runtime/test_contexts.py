"""A generation context's KV budget on a GPU, with torch's CUDA memory queries faked on this CPU."""

from __future__ import annotations

import torch

from pivotrl.engine.kv_budget import AUTO_FRACTION
from pivotrl.runtime.contexts import ContextSpec, kv_budget

GIB = 1 << 30


def fake_gpu(monkeypatch, free: int, total: int, allocated: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_what_the_device_holds_counts_against_its_share(monkeypatch):
    fake_gpu(monkeypatch, free=65 * GIB, total=80 * GIB, allocated=15 * GIB)
    half = kv_budget(ContextSpec(device="cuda", memory_share=0.5), torch.device("cuda"), 15 * GIB)
    assert half.nbytes == int(AUTO_FRACTION * 25 * GIB)  # its half of the GPU, less its weights
    whole = kv_budget(ContextSpec(device="cuda"), torch.device("cuda"), 15 * GIB)
    assert whole.nbytes == int(AUTO_FRACTION * 65 * GIB)
