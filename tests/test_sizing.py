"""How many devices an instance needs (pivotrl.sizing): each engine's part of a device, case by case."""

import dataclasses

import pytest

from pivotrl.config import load_config
from pivotrl.resolve import CUDA_CONTEXT_BYTES, GB
from pivotrl.sizing import ENGINE_FRACTION, NODE_GPUS, Engine, describe, sizing
from tests.test_resolve import QWEN2_5_32B, SMALL
from tests.train.test_memory import QWEN2_5_7B

VLLM = {"rollout": "vllm", "judge": "vllm"}
BF16 = {"rollout": "bfloat16", "judge": "bfloat16"}
LENS = {"rollout": 352, "judge": 496}  # (the default job's, with 256-token prompts)


def size(*overrides: str, gb: float = 80, judge=QWEN2_5_32B, backends=VLLM):
    cfg = load_config(None, ["devices=8", *overrides])
    return sizing(cfg, gb * GB, {"rollout": QWEN2_5_7B, "judge": judge}, BF16, backends, LENS)


def test_an_engine_holds_its_weights_and_its_batch_s_kv_cache_cut_in_as_many_parts_as_its_kv_heads_allow():
    judge = Engine("judge", QWEN2_5_32B, "bfloat16", 64, 496)
    per_token = 2 * 64 * 8 * 128 * 2  # K and V, 64 layers, 8 KV heads of 128, bf16
    assert judge.kv == 64 * 496 * per_token
    assert judge.per_device(2) == (judge.weights / 2, judge.kv / 2)
    policy = Engine("rollout", QWEN2_5_7B, "bfloat16", 64, 352)  # 4 KV heads: on 8 devices each is held on 2
    assert policy.per_device(8) == (policy.weights / 8, policy.kv / 4)
    fixed = dataclasses.replace(policy, kv_cache_bytes=3 * GB)  # rollout.kv_cache_gb: what each engine allocates
    assert fixed.per_device(2) == (policy.weights / 2, 3 * GB)
    assert Engine("judge", QWEN2_5_32B, "float32", 64, 496).weights == 2 * judge.weights


def test_a_size_holds_an_engine_within_the_share_of_a_device_an_engine_takes_beside_every_process_context():
    s = size()
    judge = s.engines[1]
    assert s.processes == 3 and s.limit == ENGINE_FRACTION * 80 * GB
    assert s.need(judge, 1) == judge.weights + judge.kv + 3 * CUDA_CONTEXT_BYTES
    assert not s.holds(judge, 1) and s.holds(judge, 2)  # 75.3 GB, 38.4 GB of 68
    assert (s.fewest(s.engines[0]), s.fewest(judge), s.auto()) == (1, 2, 2)
    assert size("rollout.max_batch=1").auto() == 1  # (one judgment beside the weights: 67.2 GB)
    assert size(gb=24, judge=SMALL).auto() == 1 and size(gb=20, judge=SMALL).auto() == 2  # (the 7B: 18.0 GB)
    assert size(gb=5).fewest(judge) is None  # (more than a node's devices)


@pytest.mark.parametrize(
    ("overrides", "backends", "allowed"),
    [
        ((), VLLM, (1, 2, 4)),  # the 7B policy's 28 heads are not cut in 8
        (("devices=6",), VLLM, (1, 2)),  # divisors of the devices
        (("devices=16",), VLLM, (1, 2, 4)),  # a node's 8 at most
        ((), {"rollout": "vllm", "judge": "native"}, (1,)),  # the native engine serves one device
    ],
)
def test_auto_chooses_among_the_divisors_of_the_devices_a_node_holds_that_every_model_can_be_cut_in(
    overrides, backends, allowed
):
    assert size(*overrides, backends=backends).allowed == allowed
    assert NODE_GPUS == 8


def test_the_arithmetic_prints_each_engine_s_fewest_devices_and_the_size_below_it():
    s = size()
    lines = describe(s.to_dict(2, auto=True), 256)
    assert "an engine takes at most 0.85 of a device, 68.0 GB" in lines[0] and "prompts of at most 256" in lines[0]
    assert (
        "  judge (32.76B in bfloat16, KV cache of 64 x 496 tokens, 8 KV heads): 2 devices: weights 32.8 + KV cache "
        "4.2 + contexts 1.5 = 38.4 GB; on 1: weights 65.5 + KV cache 8.3 + contexts 1.5 = 75.3 GB, over 68.0"
    ) in lines
    assert lines[1].startswith("  rollout, the policy (7.62B in bfloat16, KV cache of 64 x 352 tokens, 4 KV heads): 1 ")
    assert lines[-1].startswith("  -> tensor_parallel=auto takes 2: the smallest of 1, 2, 4 (divisors of devices=8")
    given = describe(s.to_dict(1, auto=False), 256)[-1]
    assert given == (
        "  -> tensor_parallel=1, as configured: on instances of 1 the judge's engine holds fewer sequences at once "
        "than the batch (vLLM preempts the rest); auto would take 2"
    )
    assert describe(size(gb=5).to_dict(4, auto=False), 256)[2].startswith(
        "  judge (32.76B in bfloat16, KV cache of 64 x 496 tokens, 8 KV heads): more than a node's 8 devices: on 8:"
    )
