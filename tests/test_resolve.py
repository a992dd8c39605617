"""The job resolved against the hardware once (pivotrl.resolve): each ``auto`` rule, case by case."""

import dataclasses
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.model.config import ModelConfig
from pivotrl.resolve import (
    CUDA_CONTEXT_BYTES,
    Hardware,
    Plan,
    backend_note,
    changed,
    describe,
    resolve,
    rollout_dtype_for,
)
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
    # instances of 4 GPUs (the runtime's, the simulator's): the step's fewest GPUs over 4, rounded up
    gpus = plan(*fsdp8).min_train_devices
    vllm = ("rollout.backend=vllm", "judge.backend=vllm")
    assert plan(*fsdp8, *vllm, "tensor_parallel=4").min_train_devices == -(-gpus // 4)


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


@pytest.mark.parametrize(
    ("judge_dtype", "kind", "bf16", "expected"),
    [
        ("auto", "cuda", True, "bfloat16"),  # served in bf16 on a GPU, as the policy's rollout copy
        ("auto", "cuda", False, "float16"),  # a GPU without bf16 (compute capability below 8.0): fp16, as vLLM's auto
        ("auto", "cpu", True, "float32"),  # a CPU's bf16 matmuls are slow
        ("float32", "cuda", True, "float32"),  # asked for: kept
        ("bfloat16", "cpu", True, "bfloat16"),
        ("float16", "cuda", False, "float16"),
        ("float32", "cuda", False, "float32"),
    ],
)
def test_judge_dtype_resolution(judge_dtype, kind, bf16, expected):
    cfg = load_config(None, [f"judge.dtype={judge_dtype}"])
    assert resolve(cfg, Hardware(kind, bf16=bf16)).judge_dtype == expected


def test_bf16_on_gpus_without_it_is_one_line_naming_the_key():
    """An explicit bfloat16 where the GPUs do not compute in it is refused (vLLM's engine would refuse it when it
    starts; torch would emulate it slowly); auto takes float16 there, for the rollout copy too."""
    no_bf16 = Hardware("cuda", bf16=False)
    for key in ("judge.dtype", "policy.rollout_dtype"):
        with pytest.raises(
            UserError,
            match=rf"^{key}=bfloat16: these GPUs do not compute in bfloat16 \(compute "
            r"capability below 8\.0\); allowed here: auto \(float16 on them\), float16 or float32$",
        ):
            resolve(load_config(None, [f"{key}=bfloat16"]), no_bf16)
    assert resolve(load_config(None, []), no_bf16).rollout_dtype == "float16"
    assert resolve(load_config(None, ["judge.dtype=bfloat16"]), Hardware("cpu", bf16=False)).judge_dtype == "bfloat16"


def test_auto_backends_are_vllm_on_cuda_where_it_is_installed_and_native_elsewhere():
    cfg = load_config(None, [])
    backends = lambda hw: (lambda p: (p.rollout_backend, p.judge_backend))(resolve(cfg, hw))  # noqa: E731
    assert backends(Hardware("cuda", vllm=True)) == ("vllm", "vllm")
    assert backends(Hardware("cuda", vllm=False)) == ("native", "native")
    assert backends(Hardware.of(cfg, "cpu", vllm=True)) == ("native", "native")  # (vLLM serves CUDA devices only)
    given = load_config(None, ["rollout.backend=native", "judge.backend=vllm"])
    assert (lambda p: (p.rollout_backend, p.judge_backend))(resolve(given, Hardware("cpu"))) == ("native", "vllm")
    # where auto takes the native engine on CUDA, the run's log says why and how to install vLLM
    note = backend_note(cfg, Hardware("cuda"), "pip install vllm")
    assert note.startswith("rollout.backend and judge.backend=auto: the native engine on CUDA, as vLLM is not")
    assert note.endswith("meant for CPUs and small models: install vLLM with pip install vllm")
    assert backend_note(load_config(None, ["judge.backend=native"]), Hardware("cuda"), "x").startswith("rollout.")
    assert backend_note(cfg, Hardware("cuda", vllm=True), "x") == backend_note(cfg, Hardware("cpu"), "x") == ""


@pytest.mark.parametrize(
    ("audit", "backend", "kind", "on"),
    [
        ("auto", "vllm", "cpu", True),  # vLLM's kernels are not batch-invariant: audited where it costs little
        ("auto", "vllm", "cuda", False),  # on a GPU it would be rollout compute on the hot path
        ("auto", "native", "cpu", False),  # the native engine's migration is exact
        ("on", "native", "cuda", True),
        ("off", "vllm", "cpu", False),
    ],
)
def test_migration_audit_resolution(audit, backend, kind, on):
    cfg = load_config(None, [f"rollout.audit_migrations={audit}", f"rollout.backend={backend}"])
    assert resolve(cfg, Hardware(kind)).audit_migrations is on


def test_the_plan_keeps_what_it_serves_with_and_reads_plans_written_before():
    p = resolve(load_config(None, []), Hardware("cuda", vllm=True))
    d = p.to_dict()
    assert (d["judge_dtype"], d["rollout_backend"], d["judge_backend"], d["audit_migrations"]) == (
        "bfloat16", "vllm", "vllm", False)  # fmt: skip
    assert p.serving() == {k: d[k] for k in ("rollout_dtype", "judge_dtype", "rollout_backend", "judge_backend",
                                             "audit_migrations", "tensor_parallel")}  # fmt: skip
    assert "  judge in bfloat16; backends: rollout vllm, judge vllm; migration audit off" in p.lines()
    old = {k: v for k, v in d.items() if k not in ("judge_dtype", "rollout_backend", "judge_backend",
                                                   "audit_migrations", "share_gb", "tensor_parallel")}  # fmt: skip
    assert describe(old) == p.lines()[:3]  # (a checkpoint's plan from before these keys: what it has)
    assert changed(old, p) == []


def test_a_devices_share_of_a_gpu_must_hold_its_largest_role_and_a_cuda_context_per_process():
    """Where the GPU's memory is known: the trainer's bytes (as for too_big), each engine's weights in its dtype
    and one sequence's KV cache, the largest of them and a CUDA context for each process of the device (the
    trainer's, one per vLLM engine); a share that cannot hold it is one line naming gpus_per_device."""
    job = ("devices=8", "mode=colocated", "train.backend=fsdp")
    lens = {"judge": QWEN2_5_7B, "judge_max_len": 1000, "rollout_max_len": 600}
    p = plan(*job, **lens)
    s = p.share
    assert s is not None and s.processes == 1  # (native engines: no process of their own)
    assert s.train == memory.per_device(QWEN2_5_7B, "fsdp", 8, 16384, 2, True)
    per_token = 2 * QWEN2_5_7B.num_hidden_layers * QWEN2_5_7B.num_key_value_heads * QWEN2_5_7B.head_dim * 2
    weights = QWEN2_5_7B.num_parameters() * 2
    assert (s.rollout, s.judge) == (weights + 600 * per_token, weights + 1000 * per_token)
    assert s.need() == max(s.train, s.judge) + CUDA_CONTEXT_BYTES and not p.too_small
    assert p.to_dict()["share_gb"]["need"] == pytest.approx(s.need() / 1e9)
    assert any(line.startswith("  a device's share of its GPU, 80.0 GB, needs ") for line in p.lines())
    # vLLM engines are processes of their own; a judge in fp32 is twice the bytes; on 20 GB only engines fit
    vllm = plan(*job, "rollout.backend=vllm", "judge.backend=vllm", "judge.dtype=float32", memory_gb=20, **lens)
    assert vllm.share is not None and vllm.share.processes == 3 and vllm.share.judge > 2 * weights
    assert vllm.too_small.startswith("gpus_per_device=1: a device's share of its GPU (20.0 GB of 20 GB) cannot hold")
    assert "the trainer, the policy's vLLM engine, the judge's vLLM engine" in vllm.too_small
    assert "\n" not in vllm.too_small
    # the trainer already fits none of the devices, run anyway (train.min_devices given): the engines are checked
    cfg = load_config(None, [*job, "gpus_per_device=0.25", "train.min_devices=2"])
    quarter = resolve(cfg, Hardware.of(cfg, "cuda", 80e9), QWEN2_5_7B, **lens)
    assert quarter.too_big and not quarter.too_small  # (the 7B engines fit a 20 GB share)
    cfg = load_config(None, ["devices=8", "gpus_per_device=0.125", "train.min_devices=2"])
    eighth = resolve(cfg, Hardware.of(cfg, "cuda", 80e9), QWEN2_5_7B, **lens)
    assert eighth.too_small.startswith("gpus_per_device=0.125: a device's share of its GPU (10.0 GB of 80 GB) "
                                       "cannot hold what it needs, ")  # fmt: skip
    assert "its largest role, judging (the judge's weights in bfloat16 and one sequence's KV cache)" in eighth.too_small
    assert "use gpus_per_device=0.2 or more" in eighth.too_small
    assert plan(*job, memory_gb=None).share is None and plan(*job, policy=None).share is None  # (not known)
    assert plan(kind="cpu", memory_gb=None).share is None


QWEN2_5_32B = ModelConfig.from_hf(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }
)  # fmt: skip


def test_an_instance_of_several_devices_counts_train_devices_in_instances():
    one = plan("devices=8", "rollout.backend=vllm", "judge.backend=vllm", "train.min_devices=4")
    two = plan("devices=8", "tensor_parallel=2", "rollout.backend=vllm", "judge.backend=vllm", "train.min_devices=4")
    assert (one.tensor_parallel, one.min_train_devices) == (1, 4)
    assert (two.tensor_parallel, two.min_train_devices) == (2, 2)  # (4 devices: 2 instances of 2)
    assert two.to_dict()["tensor_parallel"] == 2
    assert any("instances of 2 devices" in line for line in two.lines())


def test_auto_tensor_parallel_is_the_fewest_devices_that_hold_each_model():
    """Qwen2.5-7B policy, Qwen2.5-32B judge, 80 GB devices, the default batch (64) and lengths (496 judge tokens, 352
    policy tokens: 256-token prompts). On one device the judge's engine needs its bf16 weights, 65.5 GB, the KV cache
    of 64 judgments, 8.3 GB, and 3 CUDA contexts, 1.5 GB: 75.3 GB, more than the 68 GB (0.85) an engine takes. Cut in
    2: 32.8 + 4.2 + 1.5 = 38.4 GB. The policy (15.2 + 1.3 + 1.5) fits one. So 2; on 40 GB (34 an engine), 4."""
    vllm = ("devices=8", "rollout.backend=vllm", "judge.backend=vllm", "tensor_parallel=auto")
    assert plan(*vllm, judge=SMALL).tensor_parallel == 1  # a 7B policy and a small judge fit one 80 GB GPU
    assert plan(*vllm, judge=QWEN2_5_32B).tensor_parallel == 2
    assert plan(*vllm, judge=QWEN2_5_32B, memory_gb=40).tensor_parallel == 4  # 16.4 + 2.1 + 1.5 = 20.0 of 34 GB
    # the batch decides: one judgment's KV cache beside the weights fits one device (65.5 + 0.1 + 1.5 = 67.2 GB)
    assert plan(*vllm, "rollout.max_batch=1", judge=QWEN2_5_32B).tensor_parallel == 1
    # the lengths a run measures count: 4096-token judgments (64 x 4096 x 0.26 MB = 68.7 GB of KV cache) need 4
    assert plan(*vllm, judge=QWEN2_5_32B, judge_max_len=4096).tensor_parallel == 4
    assert plan(*vllm, kind="cpu", memory_gb=None, judge=QWEN2_5_32B).tensor_parallel == 1  # memory not known
    assert plan(*vllm[:3], judge=QWEN2_5_32B).tensor_parallel == 1  # (as given: not auto)


@pytest.mark.parametrize(
    ("overrides", "memory_gb", "words"),
    [
        # 8 devices of 16 GB: on 4 the judge needs 16.4 + 0.03 + 1.5 GB of 13.6 (8 would hold it, but the 7B
        # policy's 28 heads cannot be cut in 8)
        (("devices=8", "judge.backend=vllm"), 16, "of the sizes allowed here (1, 2, 4: divisors of devices=8 up to "
         "a node's 8 GPUs that every model can be cut in), on 4 the judge's engine needs 17.9 GB a device (weights "
         "16.4 + one sequence's KV cache 0.03 + 3 CUDA contexts 1.5), more than the 13.6 GB an engine takes"),
        # 2 devices of 30 GB: 2 at most
        (("devices=2", "judge.backend=vllm"), 30, "of the sizes allowed here (1, 2: divisors of devices=2"),
        # a native engine serves one device: 1 alone
        (("devices=8", "judge.backend=native"), 60, "(1: judge.backend=native serves one device; an instance of "
         "several needs vllm), on 1 the judge's engine needs 66.7 GB"),
    ],
)  # fmt: skip
def test_auto_tensor_parallel_that_no_size_starts_is_one_line_naming_the_key(overrides, memory_gb, words):
    with pytest.raises(UserError) as e:
        plan(*overrides, "rollout.backend=vllm", "tensor_parallel=auto", judge=QWEN2_5_32B, memory_gb=memory_gb)
    text = str(e.value)
    assert text.startswith("tensor_parallel=auto: no instance size holds even one sequence") and "\n" not in text
    assert words in text


def test_auto_tensor_parallel_where_no_size_holds_the_batch_is_the_smallest_that_starts():
    vllm = ("rollout.backend=vllm", "judge.backend=vllm", "tensor_parallel=auto")
    # a 32B judge's batch does not fit 2 devices of 48 GB (32.8 weights + 8.6 KV cache + 1.5 contexts > 40.8),
    # one sequence does (34.3)
    assert plan("devices=2", *vllm, judge=QWEN2_5_32B, memory_gb=48).tensor_parallel == 2
    assert plan("devices=8", *vllm, judge=QWEN2_5_32B, memory_gb=40).tensor_parallel == 4


@pytest.mark.parametrize(
    ("overrides", "model", "words"),
    [
        (("tensor_parallel=2",), SMALL, "rollout.backend=native serves one device"),
        (("tensor_parallel=2", "rollout.backend=vllm"), SMALL, "judge.backend=native serves one device"),
        (("tensor_parallel=4", "rollout.backend=vllm", "judge.backend=vllm"), SMALL,
         "policy's num_attention_heads=14 cannot be cut in 4 parts"),  # (2 KV heads: each on 2 devices, allowed)
        (("tensor_parallel=2", "rollout.backend=vllm", "judge.backend=vllm"),
         dataclasses.replace(SMALL, num_attention_heads=12, num_key_value_heads=3),
         "policy's num_key_value_heads=3 cannot be cut in 2 parts"),
        (("tensor_parallel=8", "rollout.backend=vllm", "judge.backend=vllm"), QWEN2_5_7B,
         "policy's num_attention_heads=28 cannot be cut in 8 parts (tensor parallel splits heads, KV heads and the "
         "MLP's width evenly); allowed for it: 1, 2, 4"),
    ],
)  # fmt: skip
def test_an_instance_size_the_engines_cannot_cut_is_one_line(overrides, model, words):
    with pytest.raises(UserError, match="tensor_parallel=") as e:
        plan("devices=8", *overrides, policy=model)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_judge_instance_of_several_devices_holds_their_kv_cache_together():
    vllm = ("devices=4", "rollout.backend=vllm", "judge.backend=vllm")
    judge = dataclasses.replace(SMALL, num_attention_heads=16)  # (2 KV heads; 16 heads: cut in 4)
    one = plan(*vllm, judge=judge, judge_max_len=1024)
    two = plan(*vllm, "tensor_parallel=2", judge=judge, judge_max_len=1024)
    assert two.judge_kv == pytest.approx(2 * one.judge_kv, rel=0.01)  # (each device holds one of its 2 KV heads)
    four = plan(*vllm, "tensor_parallel=4", judge=judge, judge_max_len=1024)
    assert four.judge_kv == pytest.approx(two.judge_kv, rel=0.01)  # (2 KV heads: 4 devices hold each twice)
