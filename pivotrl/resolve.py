"""The job resolved against the hardware, once: every ``auto`` made concrete in one frozen :class:`Plan`.

    JobConfig + Hardware (+ the policy's and the judge's architectures) -> resolve() -> Plan

The drivers (in-process, Ray), the devices, the simulator, ``pivotrl plan`` and checkpoints read the plan;
nothing decides a setting a second time. The hardware comes from where the job runs: the driver once its
devices are up (their kind, the memory of the smallest), the simulator's modeled GPUs, or the GPU that
``pivotrl plan --device-memory-gb`` assumes. Torch-free and Ray-free: the simulator and ``pivotrl plan``
resolve jobs without either.

What is decided here, and by which rule:

- the trainer (``train.backend``): as given; ``auto`` is ZeRO-1 on GPUs in shiftable mode where its state
  fits the job's devices (or ``train.min_devices``) and the rollout's weights are as wide as its compute
  dtype (it computes from them), else FSDP2 on GPUs (ZeRO-1 where devices share a GPU: FSDP2's collectives
  need a GPU per rank), the replicated trainer on CPUs;
- the compute precision (``train.precision``): bf16 on GPUs, fp32 on CPUs;
- the dtypes the models generate in (``policy.rollout_dtype``, ``judge.dtype``): bf16 on GPUs (fp16 on a GPU
  without bf16, as vLLM's own ``auto``), on CPUs ``policy.dtype`` for the rollout copy and fp32 for the judge
  (a CPU's bf16 matmuls are slow); an explicit bf16 on a GPU without it is refused, naming the key;
- the generation backends (``rollout.backend``, ``judge.backend``): vLLM on CUDA where it is installed, the
  native engine elsewhere (its slotted KV cache gathers every sequence's keys and values per layer and step: it
  is for CPUs and small models); the migration audit (``rollout.audit_migrations``): on with vLLM on a CPU,
  off on CUDA (it regenerates every migrated sequence: rollout compute on the hot path);
- activation checkpointing: on where a device's memory cannot hold the trainer's state and a micro batch's
  activations unchecked on the fewest devices a step may run on (``pivotrl.train.memory``);
- the fewest train devices of an optimizer step (``train.min_devices``): as given, or the fewest whose
  memory holds the trainer's state, 1 where memory is not known (CPUs);
- the judge's limits the control plane schedules by: where the judge's KV budget is known before its
  engine starts (``rollout.kv_cache_gb``, or on a GPU what the auto budget leaves after its weights), the
  judgments a native (slotted) engine holds at once, or the tokens a vLLM (paged) engine holds;
- what a device's share of a GPU must hold (``gpus_per_device``), where its memory is known: its largest role
  (the trainer's state, or an engine's weights and one sequence's KV cache) and a CUDA context for each of its
  processes (the trainer's, and one per vLLM engine); a share too small is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pivotrl.errors import UserError
from pivotrl.runtime.devices import CPU, CUDA, Kind, shares_gpu
from pivotrl.train import memory
from pivotrl.train.config import TrainConfig
from pivotrl.train.traits import TrainerKind, TrainerTraits, traits

if TYPE_CHECKING:
    from pivotrl.config import JobConfig
    from pivotrl.model.config import ModelConfig

Precision = Literal["fp32", "bf16"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTO_KV_FRACTION = 0.85  # pivotrl.engine.kv_budget.AUTO_FRACTION: of a GPU's memory left after the weights
GB = 10**9
NATIVE, VLLM = "native", "vllm"
# A process's CUDA context on a GPU (the driver's state and torch's kernels, loaded): an estimate, which
# `make gpu-check` measures (its cuda_context section). Every process on a GPU holds one, asleep or not.
CUDA_CONTEXT_BYTES = 0.5 * GB
ROLES = ("train", "rollout", "judge")


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the job runs on, as its driver (or the simulator, or ``pivotrl plan``) knows it.

    ``device_bytes``: memory of one device (its share of a GPU), the smallest where they differ; None where it
    is not known or not the limit (CPUs). ``shared``: several devices share one GPU. ``bf16``: their GPUs
    compute in bfloat16 (compute capability 8.0 or above; devices report it once bound, ``Binding.bf16``).
    ``vllm``: vLLM can serve the devices (installed where the job runs, and the devices compute on CUDA).
    """

    kind: Kind
    device_bytes: float | None = None
    shared: bool = False
    bf16: bool = True
    vllm: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (CUDA, CPU):
            raise ValueError(f"kind: got {self.kind!r}, must be {CUDA} or {CPU}")
        if self.device_bytes is not None and not self.device_bytes > 0:
            raise ValueError(f"device_bytes: got {self.device_bytes!r}, must be > 0 or None (not known)")

    @classmethod
    def of(cls, cfg: JobConfig, kind: str, gpu_bytes: float | None = None, *, bf16: bool = True, vllm: bool = False
           ) -> Hardware:  # fmt: skip
        """Devices of ``kind`` for ``cfg``, each its share (``gpus_per_device``) of GPUs of ``gpu_bytes``."""
        device_bytes = None if gpu_bytes is None or kind != CUDA else gpu_bytes * min(1.0, cfg.gpus_per_device)
        shared = shares_gpu(kind, cfg.gpus_per_device, cfg.devices)
        return cls(kind, device_bytes, shared, bf16, vllm and kind == CUDA)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Share:
    """What one device's share of a GPU must hold, in bytes. A device plays one role at a time: the largest of
    its roles' contexts, beside a CUDA context for each of its processes (those of the roles it is not playing
    sleep, but keep their context)."""

    train: float  # the trainer's state and a micro batch's activations (on all the job's devices, the least)
    rollout: float  # the policy's rollout weights and one sequence's KV cache (of an instance's GPUs, one's part)
    judge: float  # the judge's weights in its dtype and one sequence's KV cache (0: the judge is not known)
    processes: int  # processes of the device on its GPU: the trainer's, and one per vLLM engine

    @property
    def contexts(self) -> float:
        return self.processes * CUDA_CONTEXT_BYTES

    def largest(self, roles: tuple[str, ...] = ROLES) -> str:
        """The role of ``roles`` whose context is the largest."""
        return max(roles, key=lambda role: getattr(self, role))

    def need(self, roles: tuple[str, ...] = ROLES) -> float:
        """Bytes the share needs for ``roles``: the largest's context and the processes' CUDA contexts."""
        return getattr(self, self.largest(roles)) + self.contexts

    def to_dict(self) -> dict[str, float]:
        """In GB, as plans are written."""
        roles = {"train": self.train, "rollout": self.rollout, "judge": self.judge}
        return {k: v / GB for k, v in roles.items()} | {"processes": self.processes, "need": self.need() / GB}


@dataclass(frozen=True, slots=True)
class Plan:
    """The job on its hardware, every ``auto`` concrete. ``train`` is the job's ``TrainConfig`` with its
    ``auto`` keys filled in: what every train device is configured with."""

    hardware: Hardware
    trainer: TrainerKind
    train: TrainConfig
    rollout_dtype: str
    # the trainer's state fits none of the job's devices: why (a run with train.min_devices=auto stops on it)
    too_big: str = ""
    rollout_per_device: int = 0  # sequences in flight on a rollout device (0: as many as rollout.max_batch)
    judge_per_device: int = 0  # judgments in flight on a judge device (0: as many as rollout.max_batch)
    judge_kv: int = 0  # tokens of paged KV cache a judge device holds (0: no limit but its slots)
    judge_dtype: str = "float32"  # the judge's dtype in the GPS and on its devices
    rollout_backend: str = NATIVE  # generation backend of the policy
    judge_backend: str = NATIVE  # generation backend of the judge
    tensor_parallel: int = 1  # devices of an instance (one engine over them, a trainer rank on each)
    audit_migrations: bool = False  # each migrated sequence regenerated unmigrated beside it and compared
    share: Share | None = None  # what a device's share of a GPU must hold (None: its memory is not known)
    # a device's share cannot hold it: why, naming gpus_per_device (a run stops on it)
    too_small: str = ""

    def serving(self) -> dict[str, Any]:
        """What a device's generation contexts take from the plan: the fields of its ``ContextSpec`` of these
        names (the devices are configured with them once the plan is known, before any context is built)."""
        return {
            "rollout_dtype": self.rollout_dtype,
            "judge_dtype": self.judge_dtype,
            "rollout_backend": self.rollout_backend,
            "judge_backend": self.judge_backend,
            "audit_migrations": self.audit_migrations,
            "tensor_parallel": self.tensor_parallel,
        }

    @property
    def traits(self) -> TrainerTraits:
        return traits(self.trainer)

    @property
    def min_train_devices(self) -> int:
        return self.train.min_devices

    @property
    def activation_checkpointing(self) -> bool:
        return bool(self.train.activation_checkpointing)

    @property
    def compute_bytes(self) -> int:
        return 2 if self.train.precision == "bf16" else 4

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for checkpoints and run summaries."""
        return {
            "device": self.hardware.kind,
            "device_gb": None if self.hardware.device_bytes is None else self.hardware.device_bytes / GB,
            "shared_gpu": self.hardware.shared,
            "trainer": self.trainer.value,
            "min_train_devices": self.min_train_devices,
            "activation_checkpointing": self.activation_checkpointing,
            "precision": self.train.precision,
            "rollout_dtype": self.rollout_dtype,
            "rollout_per_device": self.rollout_per_device,
            "judge_per_device": self.judge_per_device,
            "judge_kv": self.judge_kv,
            "judge_dtype": self.judge_dtype,
            "rollout_backend": self.rollout_backend,
            "judge_backend": self.judge_backend,
            "audit_migrations": self.audit_migrations,
            "tensor_parallel": self.tensor_parallel,
            "share_gb": None if self.share is None else self.share.to_dict(),
        }

    def lines(self) -> list[str]:
        """The plan as ``pivotrl plan`` prints it."""
        return describe(self.to_dict())


def describe(d: dict[str, Any]) -> list[str]:
    """A plan's ``to_dict`` in a few lines (one written before a key was added says nothing of it)."""
    memory_text = "memory not known" if d["device_gb"] is None else f"{d['device_gb']:g} GB each"
    judge = []
    if d["judge_per_device"]:
        judge.append(f"{d['judge_per_device']} judgments at once")
    if d["judge_kv"]:
        judge.append(f"{d['judge_kv']} KV tokens")
    rollout = d.get("rollout_per_device") or 0
    tp = d.get("tensor_parallel", 1)
    unit = f"instance(s) of {tp} devices" if tp > 1 else "device(s)"
    lines = [
        f"resolved for {d['device']} devices ({memory_text}{', sharing GPUs' if d['shared_gpu'] else ''}):",
        f"  trainer {d['trainer']}, at least {d['min_train_devices']} train {unit} a step, "
        f"{d['precision']} compute, activation checkpointing {'on' if d['activation_checkpointing'] else 'off'}",
        f"  rollout copy in {d['rollout_dtype']}, "
        + (f"{rollout} sequences a device at once" if rollout else "as many sequences a device as rollout.max_batch")
        + "; a judge device holds "
        + (", ".join(judge) if judge else "as many judgments as rollout.max_batch"),
    ]
    if "judge_dtype" in d:
        lines.append(
            f"  judge in {d['judge_dtype']}; backends: rollout {d['rollout_backend']}, judge {d['judge_backend']}; "
            f"migration audit {'on' if d['audit_migrations'] else 'off'}"
        )
    if d.get("tensor_parallel", 1) > 1:
        lines.append(
            f"  instances of {d['tensor_parallel']} devices: one engine over each instance's devices "
            "(tensor parallel), a trainer rank on each; the roles shift whole instances"
        )
    if d.get("share_gb"):
        s, has = d["share_gb"], d["device_gb"]
        lines.append(
            f"  a device's share of its GPU, {has:.1f} GB, needs {s['need']:.1f} GB"
            f"{'' if s['need'] <= has else ' (too small)'}: its largest role (train {s['train']:.1f}, rollout "
            f"{s['rollout']:.1f}, judge {s['judge']:.1f} GB) and a CUDA context for each of its {s['processes']} "
            f"process(es) ({CUDA_CONTEXT_BYTES / GB:g} GB each, an estimate)"
        )
    return lines


def changed(saved: dict[str, Any], now: Plan) -> list[str]:
    """What differs between a checkpoint's plan and the one a resume resolved: ``key: before -> now``."""
    out = []
    for key, value in now.to_dict().items():
        if key in saved and saved[key] != value:
            out.append(f"{key}: {saved[key]} -> {value}")
    return out


def resolve(
    cfg: JobConfig,
    hw: Hardware,
    policy: ModelConfig | None = None,
    *,
    judge: ModelConfig | None = None,
    judge_max_len: int = 0,
    rollout_max_len: int = 0,
    trainer: str | None = None,
) -> Plan:
    """``cfg`` made concrete for ``hw``.

    ``policy``: the policy's architecture, which the memory rules need where ``hw`` knows its memory (None: those
    rules take their CPU answers). ``cfg.tensor_parallel`` makes a control-plane device an instance of that many
    devices (``min_train_devices`` counts instances then: the step's fewest devices over the instance's; the
    simulator resolves its jobs with ``devices`` its GPUs and ``tensor_parallel`` the GPUs of its instances).
    ``judge`` and ``judge_max_len`` (its longest sequence), ``rollout_max_len``:
    for the engines' limits. ``trainer``: the trainer a resumed run keeps (the one that wrote its state),
    instead of ``auto``'s choice.
    """
    t = cfg.train
    precision = precision_for(t, hw.kind)
    rollout_dtype = rollout_dtype_for(cfg, hw.kind, hw.bf16)
    judge_dtype = judge_dtype_for(cfg, hw.kind, hw.bf16)
    rollout_backend, judge_backend = backend_for(cfg.rollout.backend, hw), backend_for(cfg.judge.backend, hw)
    tp = tensor_parallel_for(cfg, hw, policy, judge, (rollout_dtype, judge_dtype), (rollout_max_len, judge_max_len))
    check_tensor_parallel(tp, {"policy": policy, "judge": judge}, {"rollout": rollout_backend, "judge": judge_backend})
    memory_known = hw.device_bytes is not None and policy is not None
    kind = TrainerKind(trainer) if trainer else _trainer(cfg, hw, policy, precision, rollout_dtype)
    compute = 2 if precision == "bf16" else 4
    checkpointed = _checkpointing(t, policy, kind, cfg.devices, hw.device_bytes, compute)
    too_big, fewest = "", 1
    if memory_known:
        assert policy is not None and hw.device_bytes is not None
        found = memory.fewest_devices(policy, kind, hw.device_bytes, cfg.devices, t.planned_tokens, compute,
                                      checkpointed)  # fmt: skip
        if found is None:
            too_big = _too_big(t, policy, kind, cfg.devices, hw.device_bytes, compute, checkpointed)
        fewest = found or 1
    min_devices = -(-(t.min_devices or fewest) // tp)
    train = dataclasses.replace(
        t, backend=kind.value, precision=precision, activation_checkpointing=checkpointed, min_devices=min_devices
    )
    per_device, kv = _judge_limits(cfg, hw, judge, judge_dtype, judge_backend, judge_max_len, tp)
    rollout = _rollout_limit(cfg, hw, policy, rollout_dtype, rollout_backend, rollout_max_len)
    share, too_small = None, ""
    if memory_known and hw.kind == CUDA:
        assert policy is not None
        share = Share(
            train=memory.per_device(policy, kind, cfg.devices, t.planned_tokens, compute, checkpointed),
            rollout=_engine_bytes(policy, rollout_dtype, rollout_max_len) / tp,
            judge=0.0 if judge is None else _engine_bytes(judge, judge_dtype, judge_max_len) / tp,
            processes=1 + (rollout_backend == VLLM) + (judge_backend == VLLM),
        )
        backends = {"policy": rollout_backend, "judge": judge_backend}
        too_small = _too_small(cfg, hw, share, kind, (rollout_dtype, judge_dtype), backends, bool(too_big))
    return Plan(
        hw, kind, train, rollout_dtype, too_big, rollout, per_device, kv,
        judge_dtype=judge_dtype,
        rollout_backend=rollout_backend,
        judge_backend=judge_backend,
        tensor_parallel=tp,
        audit_migrations=audit_for(cfg, rollout_backend, hw.kind),
        share=share,
        too_small=too_small,
    )  # fmt: skip


def tensor_parallel_for(cfg: JobConfig, hw: Hardware, policy: ModelConfig | None, judge: ModelConfig | None,
                       dtypes: tuple[str, str], max_lens: tuple[int, int]) -> int:  # fmt: skip
    """Devices of an instance: ``tensor_parallel`` as given; ``auto`` is the smallest size that holds every role
    (``pivotrl.sizing``: each engine's weights and the KV cache of ``rollout.max_batch`` of its longest sequences,
    cut in that many parts, beside a CUDA context per process, within the share of a device an engine takes), among
    the divisors of the job's devices up to a node's GPUs that every model can be cut in (1 beside a native
    engine); 1 where the devices' memory is not known (CPUs). ``max_lens``: the policy's and the judge's longest
    sequences, 0 where not known (then the job's bounds, ``sequence_lengths``). Where no size holds the batches,
    the smallest where every engine holds its weights and one sequence (it runs fewer at once); where none does
    even that, a ``UserError`` says so in one line, naming the key."""
    if cfg.tensor_parallel != "auto":
        return cfg.tensor_parallel
    if hw.device_bytes is None:
        return 1
    from pivotrl.sizing import sizing  # (it builds on this module's rules)

    bounds = sequence_lengths(cfg)
    s = sizing(
        cfg,
        hw.device_bytes,
        {"rollout": policy, "judge": judge},
        {"rollout": dtypes[0], "judge": dtypes[1]},
        {"rollout": backend_for(cfg.rollout.backend, hw), "judge": backend_for(cfg.judge.backend, hw)},
        {"rollout": max_lens[0] or bounds[0], "judge": max_lens[1] or bounds[1]},
    )
    tp = s.auto()
    if tp is None:
        raise UserError(s.refusal())
    return tp


def check_tensor_parallel(tp: int, models: dict[str, ModelConfig | None], backends: dict[str, str]) -> None:
    """Refuse, in one line, an instance size the engines cannot be cut in: vLLM's rules (``ModelConfig.
    verify_with_parallel_config`` and ``QKVParallelLinear`` in vLLM 0.32): the attention heads divide by it, the
    KV heads divide by it or it by them (vLLM then holds each KV head on several devices), and the MLP's width
    (an expert's, for MoE) divides by it; the native engine serves one device."""
    if tp == 1:
        return
    for role, backend in backends.items():
        if backend != VLLM:
            key = "rollout.backend" if role == "rollout" else "judge.backend"
            raise UserError(
                f"tensor_parallel={tp}: {key}={backend} serves one device (the native engine is the CPU's "
                f"reference); an instance of several devices needs {key}=vllm, or use tensor_parallel=1"
            )
    for name, m in models.items():
        bad = [] if m is None else uncut(m, tp)
        if bad:
            assert m is not None
            fits = [d for d in range(1, tp) if not uncut(m, d)]
            raise UserError(
                f"tensor_parallel={tp}: the {name}'s {' and '.join(bad)} cannot be cut in {tp} parts (tensor "
                f"parallel splits heads, KV heads and the MLP's width evenly); allowed for it: "
                f"{', '.join(map(str, fits))}"
            )


def uncut(m: ModelConfig, tp: int) -> list[str]:
    """The dimensions of ``m`` that ``tp`` devices cannot share evenly (``name=value`` each; [] where it cuts)."""
    kv = m.num_key_value_heads
    bad = [f"num_attention_heads={m.num_attention_heads}"] if m.num_attention_heads % tp else []
    if (tp % kv) if tp >= kv else (kv % tp):
        bad.append(f"num_key_value_heads={kv}")
    widths = {"intermediate_size": m.intermediate_size}
    if m.num_experts:
        widths["moe_intermediate_size"] = m.moe_intermediate_size
    return bad + [f"{k}={v}" for k, v in widths.items() if v % tp]


PROMPT_BOUND = 256  # a prompt's token bound where the job's prompts are not measured


def sequence_lengths(cfg: JobConfig, prompt: int = PROMPT_BOUND, judge_prompt: int = PROMPT_BOUND) -> tuple[int, int]:
    """The longest policy and judge sequences (their engines' KV lengths), from bounds on their prompts' tokens:
    a policy sequence is its prompt and a response (or an evaluation's); the judge's prompt holds the response
    again, re-tokenized by its own tokenizer (twice the policy's token limit is its budget), and its judgment."""
    r = cfg.rollout
    return (
        prompt + max(r.max_new_tokens, cfg.eval.max_new_tokens),
        judge_prompt + 2 * r.max_new_tokens + cfg.judge.max_new_tokens,
    )


def precision_for(t: TrainConfig, kind: str) -> Precision:
    """The trainer's compute precision (its master weights and optimizer state are fp32 whatever this says)."""
    if t.precision != "auto":
        return t.precision
    return "bf16" if kind == CUDA else "fp32"


def rollout_dtype_for(cfg: JobConfig, kind: str, bf16: bool = True) -> str:
    """The dtype rollout devices run the policy in: generation is bound by memory bandwidth, so on a GPU it
    runs in bf16 whatever the trainer keeps; on a CPU bf16 matmuls are slow, so auto follows ``policy.dtype``.
    ``bf16``: the GPUs compute in bf16 (see :func:`serving_dtype`)."""
    return serving_dtype("policy.rollout_dtype", cfg.policy.rollout_dtype, kind, bf16, cfg.policy.dtype)


def judge_dtype_for(cfg: JobConfig, kind: str, bf16: bool = True) -> str:
    """The dtype the judge is held in (the GPS) and served in: as the rollout's on a GPU; fp32 on a CPU, whose
    bf16 matmuls are slow (the judge has no trainer's dtype to follow)."""
    return serving_dtype("judge.dtype", cfg.judge.dtype, kind, bf16, "float32")


def serving_dtype(key: str, asked: str, kind: str, bf16: bool, on_cpu: str) -> str:
    """A generating model's dtype: ``asked`` unless ``auto``; auto is bf16 on a GPU that computes in it, fp16
    on one that does not (compute capability below 8.0, as vLLM's own ``auto`` falls back: ``supported_dtypes``
    of ``vllm/platforms/cuda.py``), ``on_cpu`` on a CPU. An explicit bf16 on such a GPU is refused here, in one
    line naming ``key``: vLLM refuses it when its engine starts (``check_if_supports_dtype``), and torch would
    emulate it slowly in the native engine."""
    if kind == CUDA and not bf16 and asked == "bfloat16":
        raise UserError(
            f"{key}=bfloat16: these GPUs do not compute in bfloat16 (compute capability below 8.0); "
            "allowed here: auto (float16 on them), float16 or float32"
        )
    if asked != "auto":
        return asked
    if kind != CUDA:
        return on_cpu
    return "bfloat16" if bf16 else "float16"


def backend_for(asked: str, hw: Hardware) -> str:
    """A generation backend: ``asked`` unless ``auto``; auto is vLLM where the devices compute on CUDA and it
    is installed (``hw.vllm``), else the native engine, whose slotted KV cache (an ``index_select`` of every
    sequence's keys and values per layer and step) is meant for CPUs and small models."""
    if asked != "auto":
        return asked
    return VLLM if hw.kind == CUDA and hw.vllm else NATIVE


def backend_note(cfg: JobConfig, hw: Hardware, install: str) -> str:
    """Why a backend left at ``auto`` is the native engine on CUDA (vLLM is not installed), and how to install
    it (``install``), for the run's log; "" where there is nothing to say."""
    asked = (("rollout.backend", cfg.rollout.backend), ("judge.backend", cfg.judge.backend))
    keys = [key for key, value in asked if value == "auto"]
    if hw.kind != CUDA or hw.vllm or not keys:
        return ""
    return (
        f"{' and '.join(keys)}=auto: the native engine on CUDA, as vLLM is not installed here; its slotted KV cache "
        f"is meant for CPUs and small models: install vLLM with {install}"
    )


def audit_for(cfg: JobConfig, rollout_backend: str, kind: str) -> bool:
    """Whether each migrated sequence is regenerated from scratch beside it and compared
    (``rollout.audit_migrations``): auto is on with vLLM on a CPU, whose kernels are not batch-invariant (the
    native engine's migration is exact), and off on CUDA, where the regeneration is rollout compute on the hot
    path."""
    if cfg.rollout.audit_migrations != "auto":
        return cfg.rollout.audit_migrations == "on"
    return rollout_backend == VLLM and kind != CUDA


def base_trainer(t: TrainConfig, kind: str, shared: bool) -> TrainerKind:
    """The trainer by the devices' kind alone, before the job's model and memory are known."""
    if t.backend != "auto":
        return TrainerKind(t.backend)
    if kind == CUDA:
        return TrainerKind.ZERO if shared else TrainerKind.FSDP
    return TrainerKind.REPLICATED


def _trainer(cfg: JobConfig, hw: Hardware, policy: ModelConfig | None, precision: str, rollout_dtype: str
             ) -> TrainerKind:  # fmt: skip
    base = base_trainer(cfg.train, hw.kind, hw.shared)
    t = cfg.train
    if t.backend != "auto" or base is not TrainerKind.FSDP or cfg.mode != "shiftable":
        return base
    if hw.device_bytes is None or policy is None:
        return base
    if (2 if precision == "bf16" else 4) > DTYPE_BYTES[rollout_dtype]:
        return base
    # (ZeRO-1's share only shrinks with more devices: it fits on min_devices where it fits on as few)
    most = max(cfg.devices, t.min_devices)
    compute = 2 if precision == "bf16" else 4
    zero = TrainerKind.ZERO
    checkpointed = _checkpointing(t, policy, zero, most, hw.device_bytes, compute)
    fewest = memory.fewest_devices(policy, zero, hw.device_bytes, most, t.planned_tokens, compute, checkpointed)
    return zero if fewest is not None and fewest <= (t.min_devices or most) else base


def _checkpointing(t: TrainConfig, policy: ModelConfig | None, trainer: TrainerKind, devices: int,
                   device_bytes: float | None, compute: int) -> bool:  # fmt: skip
    """``auto``: on where the state and a micro batch's activations would not fit unchecked on the fewest devices
    a step may run on: ``min_devices`` where given; with it auto too, only where no count of the job's devices
    fits unchecked (the step then runs on the fewest that fit)."""
    if isinstance(t.activation_checkpointing, bool):
        return t.activation_checkpointing
    if device_bytes is None or policy is None:
        return False
    tokens = t.planned_tokens
    if t.min_devices:
        need = memory.per_device(policy, trainer, t.min_devices, tokens, compute, checkpointed=False)
        return need > memory.HEADROOM * device_bytes
    return memory.fewest_devices(policy, trainer, device_bytes, devices, tokens, compute) is None


def _too_big(t: TrainConfig, policy: ModelConfig, trainer: TrainerKind, devices: int, device_bytes: float,
             compute: int, checkpointed: bool) -> str:  # fmt: skip
    """Why ``trainer``'s state fits none of ``devices`` devices: what a device would hold on all of them, against
    what it has, and what would shrink it. One sentence, for the runtime's error, ``pivotrl plan``'s and the
    simulator's warning."""
    need = memory.per_device(policy, trainer, devices, t.planned_tokens, compute, checkpointed) / 1e9
    other = "" if trainer is TrainerKind.FSDP else "train.backend=fsdp, "
    return (
        f"training {policy.num_parameters() / 1e9:.2f}B parameters with train.backend={trainer.value} needs "
        f"{need:.0f} GB a device even on all {devices} devices, more than {memory.HEADROOM:.0%} of their "
        f"{device_bytes / 1e9:.0f} GB (arithmetic; pivotrl plan shows it): use more devices, {other}"
        "train.activation_checkpointing=true or a smaller train.micro_batch_tokens"
    )


def _budget(cfg: JobConfig, hw: Hardware, model: ModelConfig, dtype: str, tp: int = 1) -> int | None:
    """Bytes of KV cache a device gives an engine of ``model`` in ``dtype``, where known before it starts:
    ``rollout.kv_cache_gb``, or on a GPU of known memory what the auto budget leaves after the weights (the engine
    sizes itself again from the memory free when it starts: this is the plan's figure, not a promise)."""
    if cfg.rollout.kv_cache_gb > 0:
        return int(cfg.rollout.kv_cache_gb * GB)
    if hw.kind == CUDA and hw.device_bytes is not None:
        weights = model.num_parameters() * DTYPE_BYTES[dtype] / tp  # (a device of an instance of tp: its shard)
        return max(0, int(AUTO_KV_FRACTION * (hw.device_bytes - weights)))
    return None


def kv_bytes_per_token(model: ModelConfig, dtype: str) -> int:
    """Bytes of keys and values one token holds over all layers."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * DTYPE_BYTES[dtype]


def _slots(cfg: JobConfig, budget: int, per_token: int, max_len: int) -> int:
    """Sequences of ``max_len`` tokens a slotted (native) engine holds: fewer than ``rollout.max_batch`` where
    its budget holds fewer (at least one: an engine that holds none fails when it starts, naming the key), 0
    where the budget is no limit."""
    slots = min(cfg.rollout.max_batch, budget // (per_token * max_len))
    return max(1, slots) if slots < cfg.rollout.max_batch else 0


def _rollout_limit(cfg: JobConfig, hw: Hardware, policy: ModelConfig | None, dtype: str, backend: str,
                   max_len: int) -> int:  # fmt: skip
    """Sequences a native rollout engine holds at once (0: ``rollout.max_batch``; a vLLM engine pages its cache
    and preempts, so its limit stays the batch)."""
    if policy is None or max_len < 1 or backend == VLLM:
        return 0
    budget = _budget(cfg, hw, policy, dtype)
    return 0 if budget is None else _slots(cfg, budget, kv_bytes_per_token(policy, dtype), max_len)


def _judge_limits(cfg: JobConfig, hw: Hardware, judge: ModelConfig | None, dtype: str, backend: str, max_len: int,
                  tp: int = 1) -> tuple[int, int]:  # fmt: skip
    """(judgments a judge device holds at once, tokens of its paged cache), 0 where not limited or not known; on
    instances of ``tp`` devices, an instance's."""
    if judge is None or max_len < 1:
        return 0, 0
    budget = _budget(cfg, hw, judge, dtype, tp)
    if budget is None:
        return 0, 0
    per_token = kv_bytes_per_token(judge, dtype)
    if backend == VLLM:  # paged: a judgment holds the blocks of its own length; the tokens are an instance's (the
        # control plane's unit), each of its tp devices holding its share of the KV heads, at least one
        return 0, max(1, budget * min(tp, judge.num_key_value_heads) // per_token)
    return _slots(cfg, budget, per_token, max_len), 0


def _engine_bytes(model: ModelConfig, dtype: str, max_len: int) -> float:
    """The least an engine of ``model`` holds on its device: its weights and one sequence's KV cache (an engine
    that holds fewer fails when it starts)."""
    return model.num_parameters() * DTYPE_BYTES[dtype] + kv_bytes_per_token(model, dtype) * max(0, max_len)


def _too_small(cfg: JobConfig, hw: Hardware, share: Share, trainer: TrainerKind, dtypes: tuple[str, str],
               backends: dict[str, str], too_big: bool) -> str:  # fmt: skip
    """Why a device's share of its GPU cannot hold what ``share`` says it needs ("" where it can): one line
    naming ``gpus_per_device``, the bytes needed and what the share holds, for the runtime's error and
    ``pivotrl plan``'s. ``dtypes``: the rollout's and the judge's; ``backends``: each model's (``policy``,
    ``judge``). A trainer whose state fits none of the devices (``too_big``) is said so by its own rule, and
    runs anyway where ``train.min_devices`` is given: only the engines are checked then."""
    assert hw.device_bytes is not None
    roles = ROLES[1:] if too_big else ROLES
    need, largest = share.need(roles), share.largest(roles)
    if need <= hw.device_bytes:
        return ""
    fraction = min(1.0, cfg.gpus_per_device)
    gpu = hw.device_bytes / fraction
    role = {
        "train": f"training ({trainer.value}: its state and a micro batch's activations on all {cfg.devices} devices)",
        "rollout": f"rollout (the policy's weights in {dtypes[0]} and one sequence's KV cache)",
        "judge": f"judging (the judge's weights in {dtypes[1]} and one sequence's KV cache)",
    }[largest]
    processes = ", ".join(["the trainer", *(f"the {m}'s vLLM engine" for m, b in backends.items() if b == VLLM)])
    least = math.ceil(need / gpu * 100) / 100
    fix = (
        f"use gpus_per_device={least:g} or more"
        if least <= 1
        else "no share of one such GPU holds it: a smaller model, or GPUs with more memory"
    )
    return (
        f"gpus_per_device={cfg.gpus_per_device:g}: a device's share of its GPU ({hw.device_bytes / GB:.1f} GB of "
        f"{gpu / GB:.0f} GB) cannot hold what it needs, {need / GB:.1f} GB: its largest role, {role}, "
        f"{getattr(share, largest) / GB:.1f} GB, and a CUDA context for each of its {share.processes} "
        f"process(es) ({processes}), {share.contexts / GB:.1f} GB (an estimate); {fix} "
        "(pivotrl plan --device-memory-gb shows the arithmetic)"
    )
