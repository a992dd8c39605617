"""The vLLM backend's choices that matter only on a GPU, checked with vLLM's own code on this CPU: the model
runner its processor needs, and each engine waking only its own memory from vLLM's sleep allocator."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from pivotrl.engine import vllm_engine
from pivotrl.engine.vllm_engine import BackendUnavailableError, VllmEngine, _import_vllm, _wake_own
from tests.engine.test_protocol import vllm_shaped


class _Built(Exception):
    """Raised in place of building the engine: the test wants its arguments only."""


def engine_args(monkeypatch) -> object:
    from vllm.v1.engine.llm_engine import LLMEngine

    seen = []

    def capture(args, *a, **k):
        seen.append(args)
        raise _Built

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(capture))
    with pytest.raises(_Built):
        VllmEngine(vllm_shaped("Qwen2ForCausalLM", 0).config, torch.float32, torch.device("cpu"), 8, 160)
    return seen[0]


def test_the_engine_runs_vllms_v1_model_runner_even_where_triton_is(monkeypatch):
    import vllm.config.vllm as vllm_config

    args = engine_args(monkeypatch)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    config = args.create_engine_config()
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)  # as on a CUDA build: V2 would be chosen but for the env
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is False


def test_asking_for_the_v2_runner_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(BackendUnavailableError, match="VLLM_USE_V2_MODEL_RUNNER"):
        _import_vllm()


@dataclass
class _Allocation:
    is_asleep: bool


class _Allocator:
    """vLLM's ``CuMemAllocator`` as far as waking goes: ``wake_up`` maps back every sleeping allocation."""

    def __init__(self, n: int) -> None:
        self.pointer_to_data = {ptr: _Allocation(is_asleep=True) for ptr in range(n)}

    def wake_up(self) -> None:
        for data in self.pointer_to_data.values():
            if data.is_asleep:
                data.is_asleep = False


def test_waking_one_engine_leaves_the_others_memory_asleep():
    allocator = _Allocator(6)  # 0-2 this engine's, 3-5 another's, all asleep
    _wake_own(allocator, {3, 4, 5}, allocator.wake_up)
    assert [d.is_asleep for d in allocator.pointer_to_data.values()] == [False] * 3 + [True] * 3


def test_the_others_memory_is_put_back_asleep_when_the_wake_fails():
    allocator = _Allocator(4)

    def fail() -> None:
        allocator.wake_up()
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError):
        _wake_own(allocator, {2, 3}, fail)
    assert [d.is_asleep for d in allocator.pointer_to_data.values()] == [False, False, True, True]


def test_an_engine_wakes_with_every_other_engines_allocations_hidden(monkeypatch):
    allocator = _Allocator(5)
    monkeypatch.setattr(vllm_engine, "_sleep_allocator", lambda: allocator)
    monkeypatch.setattr(vllm_engine, "_OWNED", {1: {0, 1}, 2: {2, 3}, 3: {4}})
    engine = VllmEngine.__new__(VllmEngine)  # (its state only: no vLLM engine is built)
    engine.channel, engine.asleep = 1, True

    class _LLM:
        wake_up = staticmethod(allocator.wake_up)

    engine.llm = _LLM()
    engine.wake()
    assert not engine.asleep
    assert [d.is_asleep for d in allocator.pointer_to_data.values()] == [False, False, True, True, True]


def test_engines_of_one_shape_are_built_from_one_directory_kept_for_the_compile_cache():
    import json

    from pivotrl.engine.vllm_engine import _model_dir

    config = vllm_shaped("Qwen2ForCausalLM", 0).config
    a, b = _model_dir(config.to_hf("bfloat16")), _model_dir(config.to_hf("bfloat16"))
    assert a == b
    assert _model_dir(config.to_hf("float32")) != a
    with open(os.path.join(a, "config.json")) as f:
        assert json.load(f) == config.to_hf("bfloat16")
