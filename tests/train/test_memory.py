"""The train memory arithmetic: each trainer's state by the bytes a parameter it holds, and the fewest devices."""

from __future__ import annotations

import pytest

from pivotrl.model.config import ModelConfig
from pivotrl.train import memory

QWEN2_5_7B = ModelConfig.from_hf(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    }
)
P = QWEN2_5_7B.num_parameters()


def test_the_7b_policy_has_its_published_parameter_count():
    assert P == 7_615_616_512  # Qwen2.5-7B: 7.61B parameters


@pytest.mark.parametrize("world", [1, 2, 8])
def test_each_trainer_holds_its_bytes_a_parameter(world):
    fsdp = memory.state_bytes(QWEN2_5_7B, "fsdp", world)
    assert fsdp["fp32 weights, gradients, AdamW moments (1/W)"] == pytest.approx(16 * P / world)
    assert ("2 layers gathered" in memory.state_bytes(QWEN2_5_7B, "fsdp", world, 4)) == (world > 1)  # (fp32 on one
    # device: nothing gathered, nothing cast)
    assert sum(memory.state_bytes(QWEN2_5_7B, "zero", world).values()) == pytest.approx((6 + 12 / world) * P)
    assert sum(memory.state_bytes(QWEN2_5_7B, "zero", world, 4).values()) == pytest.approx((8 + 12 / world) * P)
    assert sum(memory.state_bytes(QWEN2_5_7B, "replicated", world).values()) == pytest.approx(18 * P)
    assert sum(memory.state_bytes(QWEN2_5_7B, "replicated", world, 4).values()) == pytest.approx(16 * P)


def test_checkpointing_keeps_one_layer_of_activations():
    full = sum(memory.activation_bytes(QWEN2_5_7B, 8192).values())
    kept = sum(memory.activation_bytes(QWEN2_5_7B, 8192, checkpointed=True).values())
    assert kept < full / 5
    # the log-probs' fp32 logits are chunked: a longer micro batch holds no more of them
    assert memory.activation_bytes(QWEN2_5_7B, 8192)["log-probs chunk (fp32)"] == 3 * 1024 * 152064 * 4


def test_the_fewest_devices_are_the_first_whose_share_fits():
    at = {w: memory.per_device(QWEN2_5_7B, "fsdp", w, 8192, checkpointed=True) for w in range(1, 9)}
    assert all(at[w + 1] < at[w] for w in range(1, 8))
    device = (at[3] + at[2]) / 2 / memory.HEADROOM  # the share of 3 fits, that of 2 does not
    assert memory.fewest_devices(QWEN2_5_7B, "fsdp", device, 8, 8192, checkpointed=True) == 3
    assert memory.fewest_devices(QWEN2_5_7B, "fsdp", device, 2, 8192, checkpointed=True) is None
    assert memory.fewest_devices(QWEN2_5_7B, "replicated", 80e9, 64, 8192) is None  # 18 bytes a parameter


def test_activation_checkpointing_must_be_a_bool_or_auto():
    from pivotrl.train.config import TrainConfig

    with pytest.raises(ValueError, match="train.activation_checkpointing must be true, false or auto, got 'on'"):
        TrainConfig(activation_checkpointing="on")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="trainer: got 'ddp', must be one of fsdp, zero, replicated"):
        memory.state_bytes(QWEN2_5_7B, "ddp", 1)
    with pytest.raises(ValueError, match="world: got 0, must be >= 1"):
        memory.state_bytes(QWEN2_5_7B, "fsdp", 0)
