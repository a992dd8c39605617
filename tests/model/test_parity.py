"""Logits parity with transformers on random-weight checkpoints, plus checkpoint loading and saving.

Each case builds a tiny transformers model from its own config class, draws large random weights (so that
every parameter moves the logits), saves it with ``save_pretrained`` and loads it with ``load_model``.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from pivotrl.model import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    Decoder,
    KVCache,
    UnsupportedModelError,
    char_tokenizer,
    load_model,
    save_model,
)

TOL = 1e-4
VOCAB = 128  # larger than the char tokenizer's 99 ids, as real checkpoints pad their vocabularies
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# the reference loops: transformers' default experts kernel (grouped_mm) needs 16-byte strides, which odd widths lack
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}

# name -> (config class, extra config fields)
CASES = {
    "qwen2": (Qwen2Config, {}),
    "llama": (LlamaConfig, {"attention_bias": True}),
    "llama-mlp-bias": (LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    "llama-no-gqa": (LlamaConfig, {"num_key_value_heads": 4}),
    # q/k norm, and head_dim 12 while hidden / heads = 8
    "qwen3": (Qwen3Config, {"head_dim": 12}),
    "qwen3-bias": (Qwen3Config, {"head_dim": 8, "attention_bias": True}),
    "qwen2-tied": (Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3-tied": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),
    # head_dim 16 puts one frequency in llama3's smoothed band (wavelength between 16 and 64)
    "llama3-rope": (LlamaConfig, {"hidden_size": 64, "rope_parameters": LLAMA3_ROPE}),
    "rope-theta": (Qwen2Config, {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.5}}),
    # experts: odd counts, top-k and widths; dense layers among the sparse ones by each of transformers' two rules
    "qwen3-moe": (
        Qwen3MoeConfig,
        {
            "hidden_size": 24,
            "head_dim": 12,
            "intermediate_size": 40,
            "moe_intermediate_size": 20,
            "num_hidden_layers": 3,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3-moe-norm-topk": (
        Qwen3MoeConfig,
        {
            "hidden_size": 36,
            "head_dim": 10,
            "intermediate_size": 52,
            "moe_intermediate_size": 18,
            "num_hidden_layers": 4,
            "num_experts": 7,
            "num_experts_per_tok": 3,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
    ),
}


def hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**{**SMALL, **extra}), **EAGER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)  # norm gains near 1 keep the logits spread out
    return model.float().eval()


def write_checkpoint(case: str, path: Path, **save_kwargs) -> torch.nn.Module:
    model = hf_model(case)
    model.save_pretrained(path, **save_kwargs)
    char_tokenizer().save(path)
    return model


def token_batch(seed: int = 1, rows: int = 3, length: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, length), generator=g)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.fixture(params=list(CASES), scope="module")
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_checkpoint(request.param, path)


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    case, path, reference = checkpoint
    model, _ = load_model(path)
    ids = token_batch()
    want = hf_logits(reference, ids)
    assert want.std() > 0.5, "logits too flat to tell implementations apart"
    assert max_diff(model(ids), want) <= TOL


@torch.no_grad()
def test_config_switches_are_read(checkpoint):
    """The case is discriminating: each switch the checkpoint sets reaches the decoder."""
    case, path, _ = checkpoint
    cfg = load_model(path)[0].config
    config_class, extra = CASES[case]
    assert cfg.architecture == type(checkpoint[2]).__name__
    assert cfg.qkv_bias == (config_class is Qwen2Config or extra.get("attention_bias", False))
    assert cfg.o_bias == extra.get("attention_bias", False)
    assert cfg.mlp_bias == extra.get("mlp_bias", False)
    assert cfg.qk_norm == (config_class in (Qwen3Config, Qwen3MoeConfig))
    assert cfg.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    hidden = extra.get("hidden_size", SMALL["hidden_size"])
    assert cfg.head_dim == extra.get("head_dim", hidden // SMALL["num_attention_heads"])
    assert cfg.num_key_value_heads == extra.get("num_key_value_heads", SMALL["num_key_value_heads"])
    rope = extra.get("rope_parameters", {})
    assert cfg.rope_theta == rope.get("rope_theta", 10000.0)
    assert bool(cfg.rope_scaling) == (rope.get("rope_type") == "llama3")
    assert cfg.num_experts == extra.get("num_experts", 0)
    assert cfg.num_experts_per_tok == extra.get("num_experts_per_tok", 0)
    assert cfg.moe_intermediate_size == extra.get("moe_intermediate_size", 0)
    assert cfg.norm_topk_prob == extra.get("norm_topk_prob", False)
    assert cfg.decoder_sparse_step == extra.get("decoder_sparse_step", 1)
    assert cfg.mlp_only_layers == extra.get("mlp_only_layers", [])


def test_num_parameters(checkpoint):
    model, _ = load_model(checkpoint[1])
    assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())


@torch.no_grad()
def test_rope_scaling_changes_logits(tmp_path):
    """Guards the llama3 case: ignoring its scaling would break parity, not pass by accident."""
    write_checkpoint("llama3-rope", tmp_path)
    model, _ = load_model(tmp_path)
    ids = token_batch()
    unscaled = Decoder(replace(model.config, rope_scaling={}))
    unscaled.load_state_dict(model.state_dict())
    assert max_diff(unscaled(ids), model(ids)) > 1e-2
    inv = torch.tensor(model.config.inv_freq())
    plain = torch.tensor(unscaled.config.inv_freq())
    kept, scaled = inv == plain, torch.isclose(inv, plain / 8)
    assert kept.any() and scaled.any() and not (kept | scaled).all(), "no frequency in the smoothed band"


@torch.no_grad()
def test_legacy_rope_scaling_key(tmp_path):
    """transformers 4.x wrote ``rope_scaling`` (no theta inside) and a top-level ``rope_theta``."""
    reference = write_checkpoint("llama3-rope", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(tmp_path)
    assert model.config.rope_theta == 500000.0 and model.config.rope_scaling
    ids = token_batch()
    assert max_diff(model(ids), hf_logits(reference, ids)) <= TOL


@torch.no_grad()
@pytest.mark.parametrize("case", ["qwen3", "qwen3-moe-norm-topk"])
def test_forward_cached_matches_full_forward(tmp_path, case):
    """Prefill of right-padded rows of different lengths, then chunks and single-token decodes, into slots
    that hold garbage from earlier use: every returned logit row equals the full forward at that position."""
    write_checkpoint(case, tmp_path)
    model, _ = load_model(tmp_path)
    seqs = token_batch(seed=2, rows=3, length=24)
    full = model(seqs)
    cache = KVCache(model.config, slots=6, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    cache.k.normal_(0, 5.0)
    cache.v.normal_(0, 5.0)
    slots = torch.tensor([4, 0, 2])
    done = torch.zeros(3, dtype=torch.long)

    def step(lengths: list[int]) -> None:
        n = torch.tensor(lengths)
        width = max(lengths)
        ids = torch.zeros(3, width, dtype=torch.long)
        for b in range(3):
            ids[b, : lengths[b]] = seqs[b, done[b] : done[b] + lengths[b]]
        got = model.forward_cached(ids, done.clone(), n, slots, cache)
        done.add_(n)
        want = full[torch.arange(3), done - 1]
        assert max_diff(got, want) <= TOL, lengths

    step([5, 11, 1])  # prefill, rows of different lengths
    for _ in range(4):
        step([1, 1, 1])  # decode
    step([3, 1, 6])  # chunks at different offsets
    for _ in range(3):
        step([1, 1, 1])
    assert done.tolist() == [15, 19, 14]


@torch.no_grad()
def test_forward_cached_rejects_overflow(tmp_path):
    write_checkpoint("qwen2", tmp_path)
    model, _ = load_model(tmp_path)
    cache = KVCache(model.config, slots=1, max_len=8, dtype=torch.float32, device=torch.device("cpu"))
    ids = token_batch(rows=1, length=9)
    with pytest.raises(ValueError, match="9 tokens exceeds the KV cache length 8"):
        model.forward_cached(ids, torch.tensor([0]), torch.tensor([9]), torch.tensor([0]), cache)


@torch.no_grad()
def test_sharded_checkpoint(tmp_path):
    reference = write_checkpoint("llama", tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    model, _ = load_model(tmp_path)
    ids = token_batch()
    assert max_diff(model(ids), hf_logits(reference, ids)) <= TOL


def test_pickled_weights_refused(tmp_path):
    model = write_checkpoint("qwen2", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


def test_no_weights(tmp_path):
    write_checkpoint("qwen2", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_missing_weight_named(tmp_path):
    """A checkpoint of another shape (here: no attention bias where Qwen2 needs one) names the missing keys."""
    hf_model("llama-no-gqa").save_pretrained(tmp_path)
    char_tokenizer().save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"], raw["model_type"] = ["Qwen2ForCausalLM"], "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 99, "n_embd": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    char_tokenizer().save(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "change, match",
    [
        pytest.param({"hidden_act": "gelu"}, "hidden_act", id="activation"),
        pytest.param({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn", id="rope-type"),
        pytest.param({"use_sliding_window": True}, "sliding", id="sliding-window"),
    ],
)
def test_unsupported_variant(tmp_path, change, match):
    write_checkpoint("qwen2", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    char_tokenizer().save(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_unknown_dtype(tmp_path):
    write_checkpoint("qwen2", tmp_path)
    with pytest.raises(CheckpointError, match="float64"):
        load_model(tmp_path, dtype="float64")


@torch.no_grad()
def test_bfloat16_load(tmp_path):
    reference = write_checkpoint("qwen2", tmp_path)
    model, _ = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = token_batch()
    want = hf_logits(reference, ids)
    assert max_diff(model(ids).float(), want) <= 0.1 * float(want.abs().max())


@torch.no_grad()
def test_save_load_round_trip(checkpoint, tmp_path):
    case, path, _ = checkpoint
    model, tok = load_model(path)
    save_model(model, tok, tmp_path)
    again, tok2 = load_model(tmp_path)
    assert again.config == model.config
    first, second = model.state_dict(), again.state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    if model.config.tie_word_embeddings:
        assert again.lm_head.weight is again.model.embed_tokens.weight
    assert tok2.eos_token_ids == tok.eos_token_ids
    assert tok2.bos_token_id == tok.bos_token_id
    assert tok2.pad_token_id == tok.pad_token_id
    ids = token_batch()
    assert torch.equal(again(ids), model(ids))


@torch.no_grad()
def test_transformers_loads_saved_model(checkpoint, tmp_path):
    """What save_model writes is an ordinary checkpoint: transformers gives the same logits."""
    case, path, _ = checkpoint
    model, tok = load_model(path)
    save_model(model, tok, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, **EAGER).float().eval()
    assert type(theirs).__name__ == model.config.architecture
    ids = token_batch()
    assert max_diff(hf_logits(theirs, ids), model(ids)) <= TOL


def test_chunked_logprobs_equal_the_full_computation_in_values_and_gradients():
    """Log-probs scored chunk by chunk (with recomputation in backward) equal log_softmax over full logits."""
    from pivotrl.model.decoder import chunked_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(11, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (11,))
    full = torch.log_softmax((hidden @ weight.T) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    (g_full_h, g_full_w) = torch.autograd.grad((full * torch.arange(11.0)).sum(), (hidden, weight))
    for chunk in (1, 3, 11, 64):
        got = chunked_logprobs(hidden, weight, targets, 0.7, chunk)
        torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-5)  # logsumexp vs log_softmax: float rounding
        g_h, g_w = torch.autograd.grad((got * torch.arange(11.0)).sum(), (hidden, weight))
        torch.testing.assert_close(g_h, g_full_h, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_w, g_full_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_logprobs(hidden, weight, targets, 1.0, 0)
