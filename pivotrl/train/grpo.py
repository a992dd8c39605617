"""GRPO policy update with token-level loss aggregation.

The batch of a step arrives group by group (a prompt's responses are judged
together), so the trainer must be able to start backward before the whole
batch is known. Every loss here is therefore a *sum* over response tokens;
gradients accumulate in ``.grad`` and ``GRPOTrainer.step`` divides them once by
the token count of the whole batch. Accumulating groups in any order, with any
micro-batch size, gives the same update as one pass over the full batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from pivotrl.log import logger
from pivotrl.sample import Sample
from pivotrl.train.advantages import group_advantages  # noqa: F401  (re-exported)
from pivotrl.train.config import TrainConfig


def token_logprobs(model: nn.Module, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``out[b, t] = log p(input_ids[b, t + 1] | input_ids[b, :t + 1])``, shape ``[B, T - 1]``.

    Computed in float32 as target logit minus logsumexp, so no second
    ``[B, T, V]`` log-softmax tensor is kept alongside the logits.
    """
    logits = model(input_ids)[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    target = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return target - torch.logsumexp(logits, dim=-1)


def grpo_loss_sum(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (+ k3 KL), summed over the masked tokens.

    Not normalised: the caller divides by the response tokens of the whole
    batch once known, which is what lets groups accumulate separately. The
    stats are sums (or extremes) so that they merge across micro-batches.
    """
    mask = mask.bool()
    m = mask.to(logprobs.dtype)
    # zero the log-ratio off the mask so padding can never overflow exp (inf * 0 = nan, also in backward)
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    adv = advantages.to(logprobs.dtype)[:, None]
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    per_token = pg
    stats: dict[str, float] = {}
    if kl_coef > 0 and ref_logprobs is not None:
        d = torch.where(mask, ref_logprobs - logprobs, 0.0)
        k3 = d.exp() - d - 1
        per_token = pg + kl_coef * k3
        stats["kl_sum"] = float((k3.detach() * m).sum())
    loss = (per_token * m).sum()
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    ratios = ratio.detach()[mask]
    stats |= {
        "loss_sum": float(loss.detach()),
        "pg_loss_sum": float((pg.detach() * m).sum()),
        "clipped_tokens": float((clipped & mask).sum()),
        "tokens": float(m.sum()),
    }
    if ratios.numel():
        stats["ratio_max"] = float(ratios.max())
        stats["ratio_min"] = float(ratios.min())
    return loss, stats


def _merge(into: dict[str, float], stats: dict[str, float]) -> None:
    """Fold micro-batch stats into running ones: extremes by max/min, the rest by sum."""
    for key, value in stats.items():
        if key not in into:
            into[key] = value
        elif key.endswith("_max"):
            into[key] = max(into[key], value)
        elif key.endswith("_min"):
            into[key] = min(into[key], value)
        else:
            into[key] += value


class GRPOTrainer:
    """Accumulates GRPO gradients sample group by sample group, then takes one optimizer step."""

    def __init__(
        self, model: nn.Module, cfg: TrainConfig, temperature: float = 1.0, ref_model: nn.Module | None = None
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the rollout temperature), got {temperature}")
        self.temperature = temperature
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"train.kl_coef is {cfg.kl_coef} (> 0), which needs a ref_model; none was given")
        self.model = model
        self.cfg = cfg
        self.ref_model = ref_model
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
        self._tokens = 0
        self._stats: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def pending_tokens(self) -> int:
        """Response tokens accumulated since the last step."""
        return self._tokens

    @property
    def pending_stats(self) -> dict[str, float]:
        """Running loss sums since the last step (what a data-parallel group adds up)."""
        return dict(self._stats)

    def discard(self) -> None:
        """Drop the accumulated gradients and sums without updating the weights."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stats, self._tokens = {}, 0

    def _pack(self, samples: list[Sample]) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded ``prompt + response`` rows, and old log-probs and mask in the next-token frame."""
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        old = torch.zeros(len(samples), width - 1)
        mask = torch.zeros(len(samples), width - 1, dtype=torch.bool)
        for b, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids[b, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
            old[b, p - 1 : p + r - 1] = torch.tensor(s.logprobs)
            mask[b, p - 1 : p + r - 1] = True
        return ids.to(self.device), old.to(self.device), mask.to(self.device)

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Backward the unnormalised loss of these samples; gradients add up until ``step``."""
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        pairs = [(s, float(a)) for s, a in zip(samples, advantages, strict=True) if s.response_ids]
        for s, _ in pairs:
            if len(s.logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {s.uid}: {len(s.logprobs)} logprobs for {len(s.response_ids)} response tokens"
                )
            if not s.prompt_ids:
                raise ValueError(f"sample {s.uid}: empty prompt_ids; the first response token needs a context")
        # longest first, so each micro-batch pads to lengths close to its own
        pairs.sort(key=lambda pa: len(pa[0].prompt_ids) + len(pa[0].response_ids), reverse=True)
        cfg = self.cfg
        stats: dict[str, float] = {}
        for start in range(0, len(pairs), cfg.micro_batch):
            chunk = pairs[start : start + cfg.micro_batch]
            ids, old, mask = self._pack([s for s, _ in chunk])
            adv = torch.tensor([a for _, a in chunk], device=self.device)
            ref = None
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, ids, self.temperature)
            logp = token_logprobs(self.model, ids, self.temperature)
            loss, mb_stats = grpo_loss_sum(logp, old, adv, mask, cfg.clip_low, cfg.clip_high, ref, cfg.kl_coef)
            loss.backward()
            _merge(stats, mb_stats)
        self._tokens += int(stats.get("tokens", 0))
        _merge(self._stats, stats)
        return stats

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
        grad_norm = get_total_norm([p.grad for p in params])
        skipped = not bool(torch.isfinite(grad_norm))
        if skipped:
            logger.warning("non-finite grad norm %s; skipping the optimizer step", float(grad_norm))
        else:
            if self.cfg.grad_clip > 0:
                clip_grads_with_norm_(params, self.cfg.grad_clip, grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        local = max(sums.get("tokens", 0.0), 1.0)
        out = {
            "grad_norm": float(grad_norm),
            "tokens": float(n),
            "loss": sums.get("loss_sum", 0.0) / local,
            "pg_loss": sums.get("pg_loss_sum", 0.0) / local,
            "clip_frac": sums.get("clipped_tokens", 0.0) / local,
            "skipped": float(skipped),
        }
        if "kl_sum" in sums:
            out["kl"] = sums["kl_sum"] / local
        for key in ("ratio_max", "ratio_min"):
            if key in sums:
                out[key] = sums[key]
        return out

    def train_batch(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """One whole-batch update: ``accumulate`` then ``step``."""
        self.accumulate(samples, advantages)
        return self.step()
