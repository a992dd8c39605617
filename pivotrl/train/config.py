"""GRPO trainer settings (torch-free, so the job config and the control plane can import them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "fsdp", "zero", "replicated"]
Correction = Literal["none", "tis", "mis", "decoupled"]
CORRECTIONS = ("none", "tis", "mis", "decoupled")
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
    # replicated: every train device holds all of it in fp32; auto (pivotrl.resolve): on CUDA zero in
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
    # off-policy correction of the policy-gradient loss where the engine's (behaviour) log-probs differ from the
    # trainer's (pivotrl.train.loss.correction_weights): none, the PPO ratio against the engine's log-probs and its
    # clip; tis, token-level truncated importance weights min(w, cap); mis, sequence-level masked importance
    # sampling (a sequence whose weight exceeds cap contributes nothing); decoupled, decoupled PPO (the ratio and
    # its clip against the proximal policy, the trainer's weights before the update, times the behaviour weight,
    # tokens above cap masked). Every one but none takes the PPO ratio against the trainer's own log-probs
    correction: Correction = "none"
    correction_cap: float = 2.0  # C of the corrections: the bound on an importance weight, > 1
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
        check("correction", self.correction in CORRECTIONS, f"one of {', '.join(CORRECTIONS)}")
        check("correction_cap", self.correction_cap > 1, "> 1 (an importance weight's bound)")
        check("min_devices", type(self.min_devices) is int and self.min_devices >= 0, "an integer >= 0 (0 = auto)")

    @property
    def planned_tokens(self) -> int:
        """The tokens of the micro batch a device's memory is planned for."""
        return self.micro_batch_tokens or UNBOUNDED_TOKENS
