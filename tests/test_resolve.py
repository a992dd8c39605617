"""The job resolved against the hardware once (pivotrl.resolve): each ``auto`` rule, case by case."""

from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.model.config import ModelConfig
from pivotrl.resolve import Hardware, Plan, changed, resolve, rollout_dtype_for
from pivotrl.train import memory
from pivotrl.train.traits import TrainerKind
from tests.train.test_memory import QWEN2_5_7B

SMALL = ModelConfig.from_hf(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    }
)  # fmt: skip  (Qwen2.5-0.5B's shape)


def plan(*overrides: str, kind: str = "cuda", memory_gb: float | None = 80, shared: bool = False,
         policy: ModelConfig | None = QWEN2_5_7B, **kwargs) -> Plan:  # fmt: skip
    cfg = load_config(None, list(overrides))
    hw = Hardware(kind, None if memory_gb is None else memory_gb * 1e9, shared)  # type: ignore[arg-type]
    return resolve(cfg, hw, policy, **kwargs)


def test_auto_trainer_is_zero_in_shiftable_mode_where_its_state_fits():
    """train.backend=auto on GPUs: ZeRO-1 (backward while the rollout runs) in shiftable mode where its state fits
    on the job's devices (or on train.min_devices), FSDP2 where it does not or in the static modes, ZeRO-1 where
    devices share a GPU, the replicated trainer on CPUs; a backend given is kept."""

    def trainer(*overrides: str, **kwargs) -> str:
        return plan("devices=8", "mode=shiftable", *overrides, **kwargs).trainer.value

    assert trainer() == "zero"  # 7.6B: ZeRO-1 fits on 6 of the 8 80 GB devices
    assert trainer("devices=4") == "fsdp"
    assert trainer("mode=disaggregated") == trainer("mode=colocated") == "fsdp"
    assert trainer("train.min_devices=2") == "fsdp"
    assert trainer("train.min_devices=6") == "zero"
    # fp32 compute: from the bf16 weights the rollout runs it would round them; from fp32 ones, with the room
    assert trainer("train.precision=fp32", memory_gb=160) == "fsdp"
    assert trainer("train.precision=fp32", "policy.rollout_dtype=float32", memory_gb=160) == "zero"
    assert trainer("train.precision=fp32", "policy.rollout_dtype=float32") == "fsdp"  # (8 bytes whole: no room)
    assert trainer(memory_gb=None) == "fsdp"  # (GPUs whose memory is not known)
    assert trainer("devices=4", shared=True) == "zero"
    assert trainer(kind="cpu", memory_gb=None) == "replicated"
    assert trainer("train.backend=fsdp") == "fsdp"
    assert trainer(kind="cpu", memory_gb=None, shared=True) == "replicated"
    assert trainer("mode=colocated", memory_gb=None, policy=None) == "fsdp"  # (by the kind alone)


@pytest.mark.parametrize(
    ("rollout_dtype", "dtype", "device", "expected"),
    [
        ("auto", "float32", "cuda", "bfloat16"),  # generation on a GPU is bandwidth-bound: bf16
        ("auto", "float32", "cpu", "float32"),  # on a CPU the trainer's dtype
        ("auto", "bfloat16", "cpu", "bfloat16"),
        ("float32", "float32", "cuda", "float32"),  # asked for: kept
        ("bfloat16", "float32", "cpu", "bfloat16"),
    ],
)
def test_rollout_dtype_resolution(rollout_dtype, dtype, device, expected):
    cfg = load_config(None, [f"policy.rollout_dtype={rollout_dtype}", f"policy.dtype={dtype}"])
    assert rollout_dtype_for(cfg, device) == expected
    assert resolve(cfg, Hardware(device)).rollout_dtype == expected  # type: ignore[arg-type]


def test_precision_is_bf16_on_gpus_fp32_on_cpus_unless_given():
    assert plan().train.precision == "bf16" and plan().compute_bytes == 2
    assert plan(kind="cpu", memory_gb=None).train.precision == "fp32"
    assert plan("train.precision=fp32").train.precision == "fp32"
    assert plan("train.precision=bf16", kind="cpu", memory_gb=None).train.precision == "bf16"


def test_auto_checkpointing_is_on_where_the_activations_would_not_fit():
    """train.activation_checkpointing=auto: the 7B policy's 16k-token micro batch needs about 100 GB of activations
    unchecked, so it checkpoints on 80 GB devices; a 0.5B one does not; nothing is known on a CPU."""
    fsdp8 = ("devices=8", "mode=colocated", "train.backend=fsdp")
    assert plan(*fsdp8).activation_checkpointing
    assert not plan(*fsdp8, policy=SMALL).activation_checkpointing
    assert not plan(*fsdp8, memory_gb=None).activation_checkpointing
    assert not plan(*fsdp8, "train.activation_checkpointing=false").activation_checkpointing
    assert plan(*fsdp8, "train.activation_checkpointing=true", kind="cpu", memory_gb=None,
                policy=SMALL).activation_checkpointing  # fmt: skip
    # decided for the fewest devices a step may run on: 2048-token micro batches fit unchecked on 3 of 8 (the
    # auto minimum then), but on 2, where the step may run when train.min_devices says so, only checked
    assert memory.fewest_devices(QWEN2_5_7B, "fsdp", 80e9, 8, 2048) == 3
    short = plan(*fsdp8, "train.micro_batch_tokens=2048")
    assert not short.activation_checkpointing and short.min_train_devices == 3
    assert plan(*fsdp8, "train.micro_batch_tokens=2048", "train.min_devices=2").activation_checkpointing


def test_min_train_devices_are_the_fewest_that_hold_the_state_or_as_given():
    fsdp8 = ("devices=8", "mode=colocated", "train.backend=fsdp")
    assert plan(*fsdp8).min_train_devices == memory.fewest_devices(QWEN2_5_7B, "fsdp", 80e9, 8, 16384, 2, True)
    assert plan(*fsdp8, "train.min_devices=5").min_train_devices == 5
    assert plan(*fsdp8, memory_gb=None).min_train_devices == 1  # (not known: one)
    assert plan(kind="cpu", memory_gb=None).min_train_devices == 1
    # the simulator's instances of 4 GPUs: the step's fewest GPUs over 4, rounded up
    gpus = plan(*fsdp8).min_train_devices
    assert plan(*fsdp8, ranks_per_device=4).min_train_devices == -(-gpus // 4)


def test_a_state_no_device_count_holds_is_said_in_one_sentence():
    p = plan("devices=2", "mode=colocated", "train.backend=replicated")
    assert p.too_big.startswith("training 7.62B parameters with train.backend=replicated needs")
    assert "use more devices, train.backend=fsdp, train.activation_checkpointing=true" in p.too_big
    assert p.min_train_devices == 1  # (a run with min_devices=auto stops on too_big; the simulator warns)
    assert not plan("devices=8", "mode=colocated", "train.backend=fsdp").too_big


def test_the_plan_fills_the_train_config_every_device_is_configured_with():
    p = plan("devices=8", "mode=shiftable")
    t = p.train
    assert (t.backend, t.precision, t.activation_checkpointing, t.min_devices) == (
        "zero", "bf16", p.activation_checkpointing, p.min_train_devices)  # fmt: skip
    assert p.trainer is TrainerKind.ZERO and not p.traits.lockstep and p.traits.unique_state
    cpu = plan(kind="cpu", memory_gb=None)
    assert cpu.train.backend == "replicated" and not cpu.traits.unique_state
    assert "auto" not in (cpu.train.backend, cpu.train.precision, cpu.train.activation_checkpointing)


def test_a_resumed_run_keeps_its_trainer_and_says_what_else_changed():
    saved = plan("devices=8", "mode=shiftable").to_dict()
    again = plan("devices=8", "mode=shiftable", memory_gb=40, trainer="zero")
    assert again.trainer is TrainerKind.ZERO  # (whatever auto would take on 40 GB devices)
    assert plan("devices=8", "mode=shiftable", memory_gb=40).trainer is TrainerKind.FSDP
    differs = changed(saved, again)
    assert "device_gb: 80.0 -> 40.0" in differs and not any(d.startswith("trainer") for d in differs)
    assert changed(saved, plan("devices=8", "mode=shiftable")) == []
    assert changed({}, again) == []  # (a checkpoint from before plans were kept)


def test_judge_limits_reach_the_control_plane_where_its_budget_is_known():
    """A native judge engine holds as many judgments as its KV budget's slots; a vLLM one as many tokens as its
    paged cache; where the budget is not known before the engine starts (a CPU, auto), no limit but the slots."""
    judge = SMALL
    per_token = 2 * judge.num_hidden_layers * judge.num_key_value_heads * judge.head_dim * 2  # bf16
    gb = f"rollout.kv_cache_gb={per_token * 1000 * 5 / 1e9}"  # five sequences of 1000 tokens
    native = plan(gb, "judge.dtype=bfloat16", "rollout.max_batch=64", judge=judge, judge_max_len=1000)
    assert (native.judge_per_device, native.judge_kv) == (5, 0)
    vllm = plan(gb, "judge.dtype=bfloat16", "judge.backend=vllm", judge=judge, judge_max_len=1000)
    assert (vllm.judge_per_device, vllm.judge_kv) == (0, 5000)
    roomy = plan("judge.dtype=bfloat16", "rollout.max_batch=64", judge=judge, judge_max_len=1000)  # auto, 80 GB
    assert (roomy.judge_per_device, roomy.judge_kv) == (0, 0)  # (all 64 fit: no limit beyond the slots)
    cpu = plan("rollout.max_batch=64", kind="cpu", memory_gb=None, judge=judge, judge_max_len=1000)
    assert (cpu.judge_per_device, cpu.judge_kv) == (0, 0)
    assert plan(gb, judge=None).judge_per_device == 0  # (no judge architecture given: not resolved)


def test_hardware_of_a_job_is_each_devices_share_of_a_gpu():
    cfg = load_config(None, ["devices=4", "gpus_per_device=0.5"])
    assert Hardware.of(cfg, "cuda", 80e9) == Hardware("cuda", 40e9, True)
    assert Hardware.of(cfg, "cpu", 80e9) == Hardware("cpu", None, False)
    with pytest.raises(ValueError, match="kind: got 'tpu', must be cuda or cpu"):
        Hardware.of(cfg, "tpu")


def test_the_plan_prints_what_it_resolved(tmp_path: Path):
    lines = "\n".join(plan("devices=8", "mode=shiftable").lines())
    assert "resolved for cuda devices (80 GB each):" in lines
    assert "trainer zero, at least" in lines and "bf16 compute" in lines and "rollout copy in bfloat16" in lines


def test_a_native_rollout_engine_whose_budget_holds_fewer_sequences_is_sent_fewer():
    policy = SMALL
    per_token = 2 * policy.num_hidden_layers * policy.num_key_value_heads * policy.head_dim * 2  # bf16 rollout
    gb = f"rollout.kv_cache_gb={per_token * 600 * 3 / 1e9}"  # three sequences of 600 tokens
    assert plan(gb, "rollout.max_batch=64", policy=policy, rollout_max_len=600).rollout_per_device == 3
    assert plan(gb, "rollout.backend=vllm", policy=policy, rollout_max_len=600).rollout_per_device == 0  # (paged)
    assert plan("rollout.max_batch=64", policy=policy, rollout_max_len=600).rollout_per_device == 0  # 80 GB: all fit
    # on a CPU the budget given is the limit too; the rollout copy is fp32 there: half as many
    assert plan(gb, kind="cpu", memory_gb=None, policy=policy, rollout_max_len=600).rollout_per_device == 1
    assert plan(kind="cpu", memory_gb=None, policy=policy, rollout_max_len=600).rollout_per_device == 0  # (auto)
