"""The replica's optimizer: GRPO gradients accumulated by :class:`~pivotrl.train.loss.GRPOLoss`, one AdamW step.

``GRPOTrainer.step`` turns the token-sum gradients into a token mean over the
whole batch (see :mod:`pivotrl.train.loss`), clips them by their global norm
and steps AdamW on the model's (float32 master) weights. The replicated and
FSDP2 trainers step through it; ZeRO-1 steps its own AdamW on a range of a
flat vector (:mod:`pivotrl.train.zero`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from pivotrl.log import logger
from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig
from pivotrl.train.loss import GRPOLoss, step_report


def _full(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) value made whole on every rank; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class GRPOTrainer(GRPOLoss):
    """Accumulates GRPO gradients sample group by sample group (:class:`GRPOLoss`), then takes one optimizer step.

    ``model`` holds the master weights (float32 for real training); with
    ``compute_dtype=torch.bfloat16`` forward and backward run under autocast
    in bfloat16 while AdamW updates the float32 weights.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        temperature: float = 1.0,
        ref_model: nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(model, cfg, temperature, ref_model, compute_dtype)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )

    def step(self, total_tokens: int | None = None, sums: dict[str, float] | None = None) -> dict[str, float]:
        """Turn the accumulated gradient sums into a token-mean gradient and update the weights.

        ``total_tokens`` is the response-token count of the whole batch; it
        defaults to what was accumulated, and may exceed it when other workers
        hold the rest of the batch. ``sums`` replaces this trainer's running
        sums in the check and the reported numbers: a data-parallel group
        passes the group's, so every rank reports the whole batch.
        """
        sums = self._stats if sums is None else sums
        accumulated = int(sums.get("tokens", 0))
        n = accumulated if total_tokens is None else total_tokens
        if n < accumulated:
            raise ValueError(f"total_tokens={n} is less than the {accumulated} tokens accumulated")
        self._stats, self._tokens = {}, 0
        params = [p for p in self.model.parameters() if p.grad is not None]
        if n == 0 or not params:
            logger.warning("no response tokens accumulated; skipping the optimizer step")
            self.optimizer.zero_grad(set_to_none=True)
            return {"tokens": 0.0, "grad_norm": 0.0, "skipped": 1.0}
        for p in params:
            p.grad.div_(n)
        grad_norm = _full(get_total_norm([p.grad for p in params]))
        skipped = not bool(torch.isfinite(grad_norm))
        if skipped:
            logger.warning("non-finite grad norm %s; skipping the optimizer step", float(grad_norm))
        else:
            if self.cfg.grad_clip > 0:
                clip_grads_with_norm_(params, self.cfg.grad_clip, grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_report(sums, n, float(grad_norm), skipped)

    def train_batch(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """One whole-batch update: ``accumulate`` then ``step``."""
        self.accumulate(samples, advantages)
        return self.step()
