"""Shared fixtures: one Ray for the session, tiny random checkpoints written like the bundled models."""

import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pivotrl.model import Decoder, ModelConfig, char_tokenizer, save_model
from pivotrl.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def one_thread() -> Iterator[None]:
    """One torch thread, as a device has: tiny models gain nothing from intra-op threads, and on a
    busy 2-core machine the thread barriers cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(
    arch: str = "Qwen2ForCausalLM",
    vocab: int = 64,
    tied: bool = False,
    bos: int | None = None,
    eos: list[int] | None = None,
    head_dim: int = 8,
) -> ModelConfig:
    """The one tiny architecture the tests build models from (2 layers, GQA 4:2, head_dim 8; vLLM's CPU
    attention needs head_dim >= 32)."""
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_word_embeddings=tied,
        bos_token_id=bos,
        eos_token_id=list(eos or []),
    )


def tiny_moe_config(vocab: int = 64) -> ModelConfig:
    """A tiny Qwen3-MoE: layer 0 sparse, layer 1 dense; 16 experts of width 8, top-2, so that a few
    tokens leave some experts unchosen."""
    return replace(
        tiny_config("Qwen3MoeForCausalLM", vocab),
        qk_norm=True,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        mlp_only_layers=[1],
    )


def tiny_model(arch: str = "Qwen2ForCausalLM", seed: int = 0, head_dim: int = 8, std: float = 0.3) -> Decoder:
    """A random model over the character tokenizer, with weights large enough that outputs vary."""
    tok = char_tokenizer()
    cfg = tiny_config(
        arch, tok.vocab_size, tied=True, bos=tok.bos_token_id, eos=list(tok.eos_token_ids), head_dim=head_dim
    )
    torch.manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random policy and a random judge: the pipeline runs for real, the judge writes garbage."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name, arch, seed in (("policy", "Qwen2ForCausalLM", 0), ("judge", "LlamaForCausalLM", 1)):
        save_model(tiny_model(arch, seed), char_tokenizer(), root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same pair in shapes vLLM's CPU attention accepts (head_dim 32), peaked enough that vLLM's kernels
    and the native engine agree on every token."""
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    paths = {}
    for name, arch, seed in (("policy", "Qwen2ForCausalLM", 0), ("judge", "LlamaForCausalLM", 1)):
        save_model(tiny_model(arch, seed, head_dim=32, std=0.15), char_tokenizer(), root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray for the session: starting it costs seconds and most of a GB."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=512 * 1024**2,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    yield
    if started:
        ray.shutdown()


_exit_status = 0


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's status once it has reported: the interpreter's own teardown after a session
    that imported vLLM makes triton's bindings print reference-leak warnings after pytest's closing line."""
    if "triton" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


def planned(train: TrainConfig | None = None, kind: str = "cpu") -> TrainConfig:
    """A train config as a job's plan makes it concrete for devices of ``kind`` whose memory is not known: what
    a driver configures every train device with (pivotrl.resolve)."""
    from pivotrl.config import JobConfig
    from pivotrl.resolve import Hardware, resolve

    return resolve(JobConfig(train=train or TrainConfig()), Hardware(kind)).train  # type: ignore[arg-type]
