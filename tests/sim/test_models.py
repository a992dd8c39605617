import dataclasses

import pytest

from pivotrl.sim.models import MODELS, ModelSpec, get_model

QWEN7 = MODELS["Qwen2.5-7B"]
A3B = MODELS["Qwen3-30B-A3B"]
A22B = MODELS["Qwen3-235B-A22B"]


def test_registry_covers_dense_moe_and_a_small_judge():
    for name in ("Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Qwen2.5-3B"):
        assert MODELS[name].name == name
    assert min(m.total_params for m in MODELS.values()) <= 3.1e9


def test_kv_bytes_follow_the_config():
    assert QWEN7.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert A22B.kv_bytes_per_token == 2 * 94 * 4 * 128 * 2


def test_qwen25_head_dim_is_hidden_over_heads():
    assert all(m.head_dim == 128 for m in MODELS.values())


@pytest.mark.parametrize(
    ("model", "moe_intermediate"),
    [(A3B, 768), (A22B, 1536)],  # config.json moe_intermediate_size
)
def test_expert_weights_derived_from_the_card_match_the_config(model, moe_intermediate):
    from_config = 3 * model.hidden * moe_intermediate * model.experts * model.layers  # gate, up, down per expert
    assert model.expert_params == pytest.approx(from_config, rel=0.01)


def test_one_moe_token_reads_its_active_weights_and_a_batch_reads_them_all():
    assert A3B.params_read(1) == pytest.approx(A3B.active_params - A3B.lookup_params)
    assert A3B.params_read(1) < A3B.params_read(8) < A3B.params_read(256)
    assert A3B.params_read(4096) == pytest.approx(A3B.total_params - A3B.lookup_params, rel=1e-6)


def test_dense_reads_every_weight_but_the_embedding_lookup():
    assert QWEN7.params_read(1) == QWEN7.params_read(512) == QWEN7.total_params - 152064 * 3584
    tied = MODELS["Qwen2.5-3B"]
    assert tied.lookup_params == 0 and tied.params_read(1) == tied.total_params


def test_flops():
    assert QWEN7.flops_per_token == 2 * (QWEN7.total_params - QWEN7.lookup_params)
    assert A22B.flops_per_token < A22B.total_params  # MoE: 2 per *active* weight
    assert QWEN7.attention_flops(0) == 0
    assert QWEN7.forward_flops(2048) - QWEN7.forward_flops(1024) == pytest.approx(4 * 28 * 28 * 128 * 1024)
    assert QWEN7.weight_bytes == 2 * QWEN7.total_params


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"active_params": 40e9}, "active_params <= total_params"),
        ({"experts": 128, "active_experts": 0}, "experts=128, active_experts=0"),
        ({"kv_heads": 3}, "multiple of kv_heads"),
        ({"layers": 0}, "layers got 0"),
        ({"experts": 0, "active_experts": 0}, "dense model"),
    ],
)
def test_invalid_specs_say_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(A3B, **change)


def test_unknown_model_lists_the_known_ones():
    assert get_model("Qwen2.5-7B") is QWEN7
    with pytest.raises(ValueError, match="known: Qwen2.5-1.5B"):
        get_model("llama-7b")


def test_a_custom_dense_spec():
    spec = ModelSpec("tiny", 1e6, 1e6, 2, 64, 4, 2, 16, 100, True)
    assert not spec.is_moe and spec.expert_params == 0 and spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("name", ["Qwen2.5-7B", "Qwen2.5-32B", "Qwen3-30B-A3B"])
def test_a_spec_from_a_checkpoint_s_architecture_has_its_card_s_shape(name):
    """What ``pivotrl plan`` prices a policy.path's config.json with: the shape as the card's spec, the parameters
    counted from it (within 1% of the card's), a MoE token's active ones without its unrouted experts."""
    card = MODELS[name]
    spec = ModelSpec.from_config(card.train_config(), name, dtype_bytes=4)
    shape = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "tied_embeddings", "experts",
             "active_experts", "intermediate")  # fmt: skip
    assert all(getattr(spec, f) == getattr(card, f) for f in shape) and spec.dtype_bytes == 4
    assert spec.total_params == pytest.approx(card.total_params, rel=0.01)
    assert spec.active_params == pytest.approx(card.active_params, rel=0.02)
    assert spec.kv_bytes_per_token == 2 * card.kv_bytes_per_token
