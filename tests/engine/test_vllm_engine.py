"""The vLLM backend's choices that matter only on a GPU, checked with vLLM's own code on this CPU: the model
runner its processor needs, the KV pool it is handed on a shared GPU, and a sleep on a GPU other processes use."""

from __future__ import annotations

import os

import pytest
import torch

from pivotrl.engine import vllm_engine
from pivotrl.engine.vllm_engine import BackendUnavailableError, VllmEngine, import_vllm
from pivotrl.resolve import CUDA_CONTEXT_BYTES
from tests.engine.test_protocol import vllm_shaped


class _Built(Exception):
    """Raised in place of building the engine: the test wants its arguments only."""


def engine_args(monkeypatch, max_len: int = 160) -> object:
    from vllm.v1.engine.llm_engine import LLMEngine

    seen = []

    def capture(args, *a, **k):
        seen.append(args)
        raise _Built

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(capture))
    with pytest.raises(_Built):
        VllmEngine(vllm_shaped("Qwen2ForCausalLM", 0).config, torch.float32, torch.device("cpu"), 8, max_len)
    return seen[0]


def test_the_engine_runs_vllms_v1_model_runner_even_where_triton_is(monkeypatch):
    import vllm.config.vllm as vllm_config

    args = engine_args(monkeypatch)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    config = args.create_engine_config()
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)  # as on a CUDA build: V2 would be chosen but for the env
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is False


def test_the_length_limit_is_the_jobs_and_never_the_models_beyond_it(monkeypatch):
    model_limit = vllm_shaped("Qwen2ForCausalLM", 0).config.max_position_embeddings
    assert engine_args(monkeypatch, 160).max_model_len == 160 < model_limit
    assert engine_args(monkeypatch, 10 * model_limit).max_model_len == model_limit


def test_asking_for_the_v2_runner_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(BackendUnavailableError, match="VLLM_USE_V2_MODEL_RUNNER"):
        import_vllm()


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


GIB = 1 << 30
CONTEXTS = 2 * CUDA_CONTEXT_BYTES  # the device's other two processes' CUDA contexts


@pytest.mark.parametrize(
    ("name", "explicit", "cuda", "share", "want"),
    [
        ("explicit, whatever the device", 2 * GIB, True, 0.5, 2 * GIB),
        ("a whole GPU: vLLM profiles it", 0, True, 1.0, None),
        ("a shared GPU: sized here, vLLM's profile skipped", 0, True, 0.5, int(0.85 * (40 * GIB - 2 * GIB - CONTEXTS))),
        ("a CPU: every slot at full length, and some", 0, False, 1.0, int(1.25 * 8 * 512 * 1024) + (16 << 20)),
        ("never less than one sequence of the limit", 1024, True, 1.0, int(1.1 * 4096 * 1024)),
    ],
)
def test_the_kv_pool_handed_to_vllm(name, explicit, cuda, share, want):
    got = vllm_engine.kv_pool_bytes(
        explicit, cuda, share, free=70 * GIB, total=80 * GIB, weights=2 * GIB, per_token=1024, limit=4096, batch=8,
        max_len=512,
    )  # fmt: skip
    assert got == want


class _Executor:
    sleeping_tags: set[str]

    def __init__(self) -> None:
        self.sleeping_tags = set()


class _SleepingLLM:
    """An LLMEngine whose worker's sleep check fails as vLLM 0.32's does when another process allocated."""

    def __init__(self, message: str) -> None:
        self.executor = _Executor()
        self.message = message
        self.engine_core = type("Client", (), {"engine_core": type("Core", (), {"model_executor": self.executor})})

    def sleep(self, level: int) -> None:
        assert level == 2
        raise AssertionError(self.message)


def test_a_sleep_whose_check_another_process_tripped_is_a_sleep():
    llm = _SleepingLLM("Memory usage increased after sleeping.")
    vllm_engine.sleep_beside_others(llm)
    assert llm.executor.sleeping_tags == {"weights", "kv_cache"}  # (so the next wake_up maps it back)


def test_any_other_failure_of_a_sleep_is_raised():
    with pytest.raises(AssertionError, match="something else"):
        vllm_engine.sleep_beside_others(_SleepingLLM("something else"))


def test_engines_of_one_shape_are_built_from_one_directory_kept_for_the_compile_cache():
    import json

    from pivotrl.engine.vllm_engine import _model_dir

    config = vllm_shaped("Qwen2ForCausalLM", 0).config
    a, b = _model_dir(config.to_hf("bfloat16")), _model_dir(config.to_hf("bfloat16"))
    assert a == b
    assert _model_dir(config.to_hf("float32")) != a
    with open(os.path.join(a, "config.json")) as f:
        assert json.load(f) == config.to_hf("bfloat16")


def test_a_rank_holds_its_shard_by_vllms_cutting_rules():
    """A rank of an engine of two holds half of the cut weights, every KV head's projections it keeps, the norms
    whole and half of the padded vocabulary's rows; one rank holds the whole model and the vocabulary's padding."""
    from pivotrl.engine.vllm_engine import VOCAB_PADDING
    from tests.test_resolve import QWEN2_5_32B, SMALL

    def shard_parameters(m, tp):
        return m.num_parameters(tp, VOCAB_PADDING)

    m = SMALL  # (Qwen2.5-0.5B's shape: 14 heads, 2 KV heads, a tied vocabulary of 151,936 rows)
    padding = (-m.vocab_size % VOCAB_PADDING) * m.hidden_size
    assert shard_parameters(m, 1) == m.num_parameters() + padding
    per_layer_whole = 2 * m.hidden_size + m.hidden_size  # (2 norms and the KV biases' halves stay whole per rank)
    assert abs(2 * shard_parameters(m, 2) - shard_parameters(m, 1)) < m.num_hidden_layers * per_layer_whole * 4
    # 8 KV heads over 4 ranks: two each, nothing replicated but the norms
    assert abs(4 * shard_parameters(QWEN2_5_32B, 4) / QWEN2_5_32B.num_parameters() - 1) < 1e-3
