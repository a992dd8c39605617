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
- the rollout copy's dtype (``policy.rollout_dtype``): bf16 on GPUs, else ``policy.dtype``;
- activation checkpointing: on where a device's memory cannot hold the trainer's state and a micro batch's
  activations unchecked on the fewest devices a step may run on (``pivotrl.train.memory``);
- the fewest train devices of an optimizer step (``train.min_devices``): as given, or the fewest whose
  memory holds the trainer's state, 1 where memory is not known (CPUs);
- the judge's limits the control plane schedules by: where the judge's KV budget is known before its
  engine starts (``rollout.kv_cache_gb``, or on a GPU what the auto budget leaves after its weights), the
  judgments a native (slotted) engine holds at once, or the tokens a vLLM (paged) engine holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pivotrl.runtime.devices import CPU, CUDA, Kind, shares_gpu
from pivotrl.train import memory
from pivotrl.train.config import TrainConfig
from pivotrl.train.traits import TrainerKind, TrainerTraits, traits

if TYPE_CHECKING:
    from pivotrl.config import JobConfig
    from pivotrl.model.config import ModelConfig

Precision = Literal["fp32", "bf16"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
AUTO_KV_FRACTION = 0.85  # pivotrl.engine.kv_budget.AUTO_FRACTION: of a GPU's memory left after the weights
GB = 10**9


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the job runs on, as its driver (or the simulator, or ``pivotrl plan``) knows it.

    ``device_bytes``: memory of one device (its share of a GPU), the smallest where they differ; None where it
    is not known or not the limit (CPUs). ``shared``: several devices share one GPU.
    """

    kind: Kind
    device_bytes: float | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (CUDA, CPU):
            raise ValueError(f"kind: got {self.kind!r}, must be {CUDA} or {CPU}")
        if self.device_bytes is not None and not self.device_bytes > 0:
            raise ValueError(f"device_bytes: got {self.device_bytes!r}, must be > 0 or None (not known)")

    @classmethod
    def of(cls, cfg: JobConfig, kind: str, gpu_bytes: float | None = None) -> Hardware:
        """Devices of ``kind`` for ``cfg``, each its share (``gpus_per_device``) of GPUs of ``gpu_bytes``."""
        device_bytes = None if gpu_bytes is None or kind != CUDA else gpu_bytes * min(1.0, cfg.gpus_per_device)
        return cls(kind, device_bytes, shares_gpu(kind, cfg.gpus_per_device, cfg.devices))  # type: ignore[arg-type]


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
        }

    def lines(self) -> list[str]:
        """The plan as ``pivotrl plan`` prints it."""
        return describe(self.to_dict())


def describe(d: dict[str, Any]) -> list[str]:
    """A plan's ``to_dict`` in a few lines."""
    memory_text = "memory not known" if d["device_gb"] is None else f"{d['device_gb']:g} GB each"
    judge = []
    if d["judge_per_device"]:
        judge.append(f"{d['judge_per_device']} judgments at once")
    if d["judge_kv"]:
        judge.append(f"{d['judge_kv']} KV tokens")
    rollout = d.get("rollout_per_device") or 0
    return [
        f"resolved for {d['device']} devices ({memory_text}{', sharing GPUs' if d['shared_gpu'] else ''}):",
        f"  trainer {d['trainer']}, at least {d['min_train_devices']} train device(s) a step, "
        f"{d['precision']} compute, activation checkpointing {'on' if d['activation_checkpointing'] else 'off'}",
        f"  rollout copy in {d['rollout_dtype']}, "
        + (f"{rollout} sequences a device at once" if rollout else "as many sequences a device as rollout.max_batch")
        + "; a judge device holds "
        + (", ".join(judge) if judge else "as many judgments as rollout.max_batch"),
    ]


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
    ranks_per_device: int = 1,
) -> Plan:
    """``cfg`` made concrete for ``hw``.

    ``policy``: the policy's architecture, which the memory rules need where ``hw`` knows its memory (None: those
    rules take their CPU answers). ``judge`` and ``judge_max_len`` (its longest sequence), ``rollout_max_len``:
    for the engines' limits. ``trainer``: the trainer a resumed run keeps (the one that wrote its state),
    instead of ``auto``'s choice. ``ranks_per_device``: GPUs a device spans where the memory rules count GPUs
    (the simulator's instances): the step's fewest devices are its fewest GPUs over this.
    """
    t = cfg.train
    precision = precision_for(t, hw.kind)
    rollout_dtype = rollout_dtype_for(cfg, hw.kind)
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
    min_devices = t.min_devices or -(-fewest // ranks_per_device)
    train = dataclasses.replace(
        t, backend=kind.value, precision=precision, activation_checkpointing=checkpointed, min_devices=min_devices
    )
    per_device, kv = _judge_limits(cfg, hw, judge, judge_max_len)
    rollout = _rollout_limit(cfg, hw, policy, rollout_dtype, rollout_max_len)
    return Plan(hw, kind, train, rollout_dtype, too_big, rollout, per_device, kv)


def precision_for(t: TrainConfig, kind: str) -> Precision:
    """The trainer's compute precision (its master weights and optimizer state are fp32 whatever this says)."""
    if t.precision != "auto":
        return t.precision
    return "bf16" if kind == CUDA else "fp32"


def rollout_dtype_for(cfg: JobConfig, kind: str) -> str:
    """The dtype rollout devices run the policy in: generation is bound by memory bandwidth, so on a GPU it
    runs in bf16 whatever the trainer keeps; on a CPU bf16 matmuls are slow, so auto follows ``policy.dtype``.
    (Decided from the device kind alone: the devices need it before their memory is known.)"""
    if cfg.policy.rollout_dtype != "auto":
        return cfg.policy.rollout_dtype
    return "bfloat16" if kind == CUDA else cfg.policy.dtype


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


def _budget(cfg: JobConfig, hw: Hardware, model: ModelConfig, dtype: str) -> int | None:
    """Bytes of KV cache a device gives an engine of ``model`` in ``dtype``, where known before it starts:
    ``rollout.kv_cache_gb``, or on a GPU of known memory what the auto budget leaves after the weights (the engine
    sizes itself again from the memory free when it starts: this is the plan's figure, not a promise)."""
    if cfg.rollout.kv_cache_gb > 0:
        return int(cfg.rollout.kv_cache_gb * GB)
    if hw.kind == CUDA and hw.device_bytes is not None:
        weights = model.num_parameters() * DTYPE_BYTES[dtype]
        return max(0, int(AUTO_KV_FRACTION * (hw.device_bytes - weights)))
    return None


def _per_token(model: ModelConfig, dtype: str) -> int:
    """Bytes of keys and values one token holds over all layers."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * DTYPE_BYTES[dtype]


def _slots(cfg: JobConfig, budget: int, per_token: int, max_len: int) -> int:
    """Sequences of ``max_len`` tokens a slotted (native) engine holds: fewer than ``rollout.max_batch`` where
    its budget holds fewer (at least one: an engine that holds none fails when it starts, naming the key), 0
    where the budget is no limit."""
    slots = min(cfg.rollout.max_batch, budget // (per_token * max_len))
    return max(1, slots) if slots < cfg.rollout.max_batch else 0


def _rollout_limit(cfg: JobConfig, hw: Hardware, policy: ModelConfig | None, dtype: str, max_len: int) -> int:
    """Sequences a native rollout engine holds at once (0: ``rollout.max_batch``; a vLLM engine pages its cache
    and preempts, so its limit stays the batch)."""
    if policy is None or max_len < 1 or cfg.rollout.backend == "vllm":
        return 0
    budget = _budget(cfg, hw, policy, dtype)
    return 0 if budget is None else _slots(cfg, budget, _per_token(policy, dtype), max_len)


def _judge_limits(cfg: JobConfig, hw: Hardware, judge: ModelConfig | None, max_len: int) -> tuple[int, int]:
    """(judgments a judge device holds at once, tokens of its paged cache), 0 where not limited or not known."""
    if judge is None or max_len < 1:
        return 0, 0
    budget = _budget(cfg, hw, judge, cfg.judge.dtype)
    if budget is None:
        return 0, 0
    per_token = _per_token(judge, cfg.judge.dtype)
    if cfg.judge.backend == "vllm":  # paged: a judgment holds the blocks of its own length
        return 0, max(1, budget // per_token)
    return _slots(cfg, budget, per_token, max_len), 0
