"""GRPO trainer settings (torch-free, so the job config and the control plane can import them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TrainConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    clip_low: float = 0.2  # PPO ratio clip range is [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0  # k3 KL to a frozen reference; only used when > 0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    micro_batch: int = 64  # sequences per forward/backward
    scale_by_std: bool = True  # False: Dr.GRPO, advantages only mean-centred

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"train.{name} must be {allowed}, got {getattr(self, name)!r}")

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
