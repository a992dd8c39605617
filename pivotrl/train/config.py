"""GRPO trainer settings (torch-free, so the job config and the control plane can import them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pivotrl.model.config import ModelConfig

Backend = Literal["auto", "fsdp", "zero", "replicated"]
Precision = Literal["auto", "fp32", "bf16"]
BACKENDS = ("auto", "fsdp", "zero", "replicated")
PRECISIONS = ("auto", "fp32", "bf16")
UNBOUNDED_TOKENS = 16384  # the micro batch memory is planned for where micro_batch_tokens sets no bound


@dataclass(slots=True)
class TrainConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    clip_low: float = 0.2  # PPO ratio clip range is [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0  # k3 KL to the frozen initial policy (the reference); only used when > 0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    micro_batch: int = 64  # at most this many sequences per forward/backward
    micro_batch_tokens: int = 16384  # and at most this many (padded) tokens; 0 = no bound
    scale_by_std: bool = True  # False: Dr.GRPO, advantages only mean-centred
    # fsdp: parameters, gradients and AdamW state sharded over the train devices (FSDP2), groups backpropagated in
    # lockstep at the step; zero: compute-dtype weights and an fp32 gradient sum on every train device, groups
    # backpropagated as they are judged, fp32 master weights and AdamW state sharded at the step (ZeRO-1);
    # replicated: every train device holds all of it in fp32; auto (JobConfig.train_backend): on CUDA zero in
    # shiftable mode where its state fits, else fsdp (zero where devices share a GPU), replicated on CPU
    backend: Backend = "auto"
    # fp32 master weights and optimizer state always; bf16 = compute in bfloat16; auto: bf16 on CUDA, fp32 on CPU
    precision: Precision = "auto"
    # recompute each layer in backward instead of keeping its activations; auto: where a device's memory cannot
    # hold a micro batch's activations beside the trainer's state (pivotrl.train.memory's arithmetic), else off
    activation_checkpointing: bool | Literal["auto"] = "auto"
    # old log-probs of the PPO ratio from the trainer's own forward instead of the generation engine's (whose
    # kernels, vLLM's especially, differ numerically); free: the update's forward computes them anyway
    recompute_logprobs: bool = False
    # the fewest train devices an optimizer step may run on: where one device cannot hold the trainer's state
    # (fsdp: 16 bytes a parameter over the step's devices; zero: 6 whole plus 12 over them; replicated: 16
    # whole), the step waits for as many as hold it, and shiftable mode's planner brings them; 0 = auto: on
    # GPUs the fewest whose memory holds it (pivotrl.train.memory's arithmetic), elsewhere 1
    min_devices: int = 0

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):  # (inf passes "> 0"; the run saves NaNs)
                raise ValueError(f"train.{name} must be a finite number {allowed}, got {value!r}")
            if not ok:
                raise ValueError(f"train.{name} must be {allowed}, got {value!r}")

        check("lr", self.lr > 0, "> 0")
        check("weight_decay", self.weight_decay >= 0, ">= 0")
        check("beta1", 0 <= self.beta1 < 1, "in [0, 1)")
        check("beta2", 0 <= self.beta2 < 1, "in [0, 1)")
        check("eps", self.eps > 0, "> 0")
        check("clip_low", 0 <= self.clip_low < 1, "in [0, 1)")
        check("clip_high", self.clip_high >= 0, ">= 0")
        check("kl_coef", self.kl_coef >= 0, ">= 0")
        check("grad_clip", self.grad_clip >= 0, ">= 0 (0 disables clipping)")
        check("micro_batch", isinstance(self.micro_batch, int) and self.micro_batch >= 1, "an integer >= 1")
        check(
            "micro_batch_tokens",
            isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 0,
            "an integer >= 0 (0 = no bound)",
        )
        check("backend", self.backend in BACKENDS, f"one of {', '.join(BACKENDS)}")
        check("precision", self.precision in PRECISIONS, f"one of {', '.join(PRECISIONS)}")
        check(
            "activation_checkpointing",
            isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing == "auto",
            "true, false or auto",
        )
        check("recompute_logprobs", isinstance(self.recompute_logprobs, bool), "true or false")
        check("min_devices", type(self.min_devices) is int and self.min_devices >= 0, "an integer >= 0 (0 = auto)")

    def resolved_backend(self, device_type: str, shared: bool = False) -> str:
        """``auto`` made concrete for a device type ("cuda" or "cpu") without the job's model and memory (a job's
        own choice is ``JobConfig.train_backend``, which may take ZeRO-1 where this says FSDP2); ``shared``: several
        devices on one GPU, where a train group's collectives go through host memory, which FSDP2 cannot (ZeRO-1
        then)."""
        if self.backend != "auto":
            return self.backend
        if device_type == "cuda":
            return "zero" if shared else "fsdp"
        return "replicated"

    @property
    def planned_tokens(self) -> int:
        """The tokens of the micro batch a device's memory is planned for."""
        return self.micro_batch_tokens or UNBOUNDED_TOKENS

    def compute_bytes(self, device_type: str) -> int:
        """Bytes a value of the compute dtype takes on a device type."""
        return 2 if self.resolved_precision(device_type) == "bf16" else 4

    def resolved_checkpointing(
        self, config: ModelConfig, trainer: str, devices: int, device_bytes: float | None, device_type: str
    ) -> bool:
        """``activation_checkpointing`` made concrete for devices of ``device_bytes`` (None: not known, a CPU),
        training ``config`` with ``trainer`` on a job of ``devices``: ``auto`` is on where the state and a micro
        batch's activations would not fit unchecked (``pivotrl.train.memory``) on the fewest devices a step may
        run on: ``min_devices`` where it is given; with it auto too, on only where no count of the job's devices
        fits unchecked (the step then runs on the fewest that fit, ``min_devices=auto``). The driver and every
        device decide alike from the same inputs."""
        if isinstance(self.activation_checkpointing, bool):
            return self.activation_checkpointing
        if device_bytes is None:
            return False
        from pivotrl.train import memory

        tokens, c = self.planned_tokens, self.compute_bytes(device_type)
        if self.min_devices:
            need = memory.per_device(config, trainer, self.min_devices, tokens, c, checkpointed=False)
            return need > memory.HEADROOM * device_bytes
        return memory.fewest_devices(config, trainer, device_bytes, devices, tokens, c) is None

    def fewest_devices(
        self, config: ModelConfig, trainer: str, devices: int, device_bytes: float, device_type: str
    ) -> int | None:
        """The fewest train devices (at most ``devices``) of ``device_bytes`` each that hold ``trainer``'s state
        and a micro batch's activations, checkpointed as this config resolves it for them
        (``pivotrl.train.memory``); None if even ``devices`` do not."""
        from pivotrl.train import memory

        checkpointed = self.resolved_checkpointing(config, trainer, devices, device_bytes, device_type)
        c, tokens = self.compute_bytes(device_type), self.planned_tokens
        return memory.fewest_devices(config, trainer, device_bytes, devices, tokens, c, checkpointed)

    def too_big(self, config: ModelConfig, trainer: str, devices: int, device_bytes: float, device_type: str) -> str:
        """Why ``trainer``'s state of ``config`` fits none of ``devices`` devices of ``device_bytes`` (where
        ``fewest_devices`` is None): what a device would hold on all of them, against what it has, and what
        would shrink it. One sentence, for the runtime's error, ``pivotrl plan``'s and the simulator's warning."""
        from pivotrl.train import memory

        checkpointed = self.resolved_checkpointing(config, trainer, devices, device_bytes, device_type)
        need = memory.per_device(config, trainer, devices, self.planned_tokens, self.compute_bytes(device_type),
                                 checkpointed) / 1e9  # fmt: skip
        other = "" if trainer == "fsdp" else "train.backend=fsdp, "
        return (
            f"training {config.num_parameters() / 1e9:.2f}B parameters with train.backend={trainer} needs "
            f"{need:.0f} GB a device even on all {devices} devices, more than {memory.HEADROOM:.0%} of their "
            f"{device_bytes / 1e9:.0f} GB (arithmetic; pivotrl plan shows it): use more devices, {other}"
            "train.activation_checkpointing=true or a smaller train.micro_batch_tokens"
        )

    def resolved_precision(self, device_type: str) -> str:
        if self.precision != "auto":
            return self.precision
        return "bf16" if device_type == "cuda" else "fp32"
