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


def test_the_processor_is_a_vllm_logits_processor_driven_by_vllms_own_batch_updates():
    """vLLM's own BatchUpdateBuilder and SamplingParams feed the processor class vLLM builds (its abstract methods
    all given): a swap moves each request's draw with it, and the drawn tokens are the native sampler's."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality
    from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder

    from pivotrl.engine.sampling import sample
    from pivotrl.engine.vllm_engine import _KEY, _collect, _Draw, _processor_class

    cls = _processor_class()
    assert issubclass(cls, LogitsProcessor)
    proc = cls(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)), torch.device("cpu"), False)
    assert not proc.is_argmax_invariant()
    channel = 10_000  # (a channel no engine of this process uses)
    vllm_engine._LOGPROBS[channel] = {}
    draws = [_Draw(channel, 5, 123, 2, 1.0, 0, 1.0), _Draw(channel, 6, 456, 0, 0.8, 4, 1.0)]
    outputs: list[list[int]] = [[], []]
    builder = BatchUpdateBuilder()
    for row, d in enumerate(draws):
        builder.added.append((row, SamplingParams(temperature=0.0, extra_args={_KEY: d}), [1, 2], outputs[row]))
    proc.update_state(builder.get_and_reset(2))
    builder.moved.append((0, 1, MoveDirectionality.SWAP))
    proc.update_state(builder.get_and_reset(2))
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    got = proc.apply(x.clone()).argmax(-1).tolist()
    d1, d0 = draws  # rows 0 and 1 now hold the second request and the first
    want, lp = sample(x, torch.tensor([d0.seed, d1.seed]), torch.tensor([0, 2]), torch.tensor([0.8, 1.0]),
                      torch.tensor([4, 0]), torch.ones(2))  # fmt: skip
    assert got == want.tolist()
    assert _collect(channel) == {(6, 0): float(lp[0]), (5, 2): float(lp[1])}
    vllm_engine._LOGPROBS.pop(channel)


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
