"""The GRPO loss and its backward, apart from any optimizer.

The batch of a step arrives group by group (a prompt's responses are judged
together), so a trainer must be able to start backward before the whole batch
is known. Every loss here is therefore a *sum* over response tokens;
gradients accumulate (in ``.grad``, or wherever a trainer collects them) and
the optimizer step divides them once by the token count of the whole batch.
Accumulating groups in any order, with any micro-batch size, gives the same
update as one pass over the full batch.

:class:`GRPOLoss` is that backward on one device's model: pack samples into
micro batches, forward, loss, backward, running stats. Every trainer
(:mod:`pivotrl.train.registry`) backpropagates through it; what it does with
the gradient sums (all-reduce, reduce-scatter, AdamW on a shard) is its own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig


def token_logprobs(model: nn.Module, input_ids: Tensor, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """``out[b, t] = log p(input_ids[b, t + 1] | input_ids[b, :t + 1])``, shape ``[B, T - 1]``, float32.

    Only the positions of ``mask`` (bool ``[B, T - 1]``; all when ``None``) are
    computed; the others are 0. The model scores them chunk by chunk (see
    :func:`pivotrl.model.decoder.chunked_logprobs`), so no ``[B, T, V]``
    logits tensor is built.
    """
    b, t = input_ids.shape
    if mask is None:
        mask = torch.ones(b, t - 1, dtype=torch.bool, device=input_ids.device)
    flat = model(input_ids, score=mask, temperature=temperature)
    out = torch.zeros(b, t - 1, dtype=torch.float32, device=input_ids.device)
    return out.masked_scatter(mask, flat)


def micro_batches(lengths: Sequence[int], max_sequences: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices of ``lengths`` cut into micro batches, longest first, so each pads to lengths close to its own.

    A micro batch holds at most ``max_sequences`` sequences and, when
    ``max_tokens`` > 0, at most that many tokens once padded to its longest
    member; a sequence longer than ``max_tokens`` goes alone. Depends only on
    the lengths (ties keep input order), so every rank cuts the same way.
    """
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        batch = out[-1] if out else None
        if batch is not None and len(batch) < max_sequences:
            longest = lengths[batch[0]]
            if not max_tokens or (len(batch) + 1) * longest <= max_tokens:
                batch.append(i)
                continue
        out.append([i])
    return out


def grpo_loss_sum(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    recompute: bool = False,
    correction: str = "none",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (+ k3 KL), summed over the masked tokens, and its stats as 0-d
    tensors on the loss's device: reading them is a host sync, which ``host_stats`` does once, after
    the backward is queued.

    Not normalised: the caller divides by the response tokens of the whole
    batch once known, which is what lets groups accumulate separately. The
    stats are sums (or extremes) so that they merge across micro-batches.

    ``old_logprobs`` are the generation engine's. ``mismatch_sum`` sums
    ``|trainer - engine|`` over the tokens: the trainer holds the very weights
    that generated them (one update per batch), so this is the engine's
    numerical disagreement with the trainer. ``recompute`` takes the trainer's
    own log-probs as the old ones (``train.recompute_logprobs``): the same
    forward pass gives them, so it costs nothing.

    ``correction`` (``train.correction``, with ``cap``) weighs each token's
    policy-gradient term by ``correction_weights`` and takes the PPO ratio
    against the trainer's own log-probs (the proximal policy: the weights
    before this update), whatever ``recompute`` says.
    """
    mask = mask.bool()
    m = mask.to(logprobs.dtype)
    mismatch = (torch.where(mask, logprobs.detach() - old_logprobs, 0.0).abs() * m).sum()
    weights = None
    if correction != "none":
        weights, is_stats = correction_weights(logprobs.detach(), old_logprobs, mask, correction, cap)
    if recompute or weights is not None:
        old_logprobs = logprobs.detach()
    # zero the log-ratio off the mask so padding can never overflow exp (inf * 0 = nan, also in backward)
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    adv = advantages.to(logprobs.dtype)[:, None]
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    stats: dict[str, Tensor] = {}
    if weights is not None:
        pg = pg * weights
        stats |= is_stats
    per_token = pg
    if kl_coef > 0 and ref_logprobs is not None:
        d = torch.where(mask, ref_logprobs - logprobs, 0.0)
        k3 = d.exp() - d - 1
        per_token = pg + kl_coef * k3
        stats["kl_sum"] = (k3.detach() * m).sum()
    loss = (per_token * m).sum()
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    ratios = ratio.detach()
    stats |= {
        "loss_sum": loss.detach(),
        "pg_loss_sum": (pg.detach() * m).sum(),
        "clipped_tokens": (clipped & mask).sum(),
        "tokens": m.sum(),
        "mismatch_sum": mismatch,
        # (a boolean index would size its result on the host: a sync; ``host_stats`` drops them for no tokens)
        "ratio_max": torch.where(mask, ratios, -math.inf).max(),
        "ratio_min": torch.where(mask, ratios, math.inf).min(),
    }
    return loss, stats


# the largest log of an importance weight reported: exp(80) is finite in fp32 (a weight is reported, never used, past
# the cap); a token whose log-probs differ by more than this is a mismatch the stats already show
_LOG_W_REPORTED = 80.0


def correction_weights(
    prox: Tensor, behaviour: Tensor, mask: Tensor, correction: str, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights of the policy-gradient term (``[B, T]``, 0 off ``mask``, no gradient), and their stats.

    ``w_t = pi_prox(y_t) / pi_behaviour(y_t)``: the trainer's probability of a token (its weights before this
    update) over the engine's that sampled it, an older policy's where the sample is stale.

    - ``tis``: token-level truncated importance sampling, ``min(w_t, cap)``;
    - ``mis``: sequence-level masked importance sampling, every token of a sequence weighted by the sequence's
      weight ``prod_t w_t``, or by 0 where that exceeds ``cap``;
    - ``decoupled``: decoupled PPO's behaviour weight, ``w_t``, or 0 where it exceeds ``cap``.

    Stats: ``is_weight_sum`` and ``is_weight_max`` of the token weights ``w_t`` before any cap, and
    ``is_capped_tokens``, the tokens truncated or masked.
    """
    log_cap = math.log(cap)
    log_w = torch.where(mask, prox - behaviour, 0.0)
    if correction == "tis":
        capped = mask & (log_w > log_cap)
        weights = log_w.clamp(max=log_cap).exp()
    elif correction == "mis":
        log_seq = log_w.sum(dim=1, keepdim=True)  # (0 off the mask)
        capped = mask & (log_seq > log_cap)
        weights = torch.where(capped, 0.0, log_seq.clamp(max=log_cap).exp().expand_as(log_w))
    elif correction == "decoupled":
        capped = mask & (log_w > log_cap)
        weights = torch.where(capped, 0.0, log_w.clamp(max=log_cap).exp())
    else:
        raise ValueError(f"train.correction must be one of none, tis, mis, decoupled, got {correction!r}")
    reported = log_w.clamp(max=_LOG_W_REPORTED).exp()
    stats = {
        "is_weight_sum": torch.where(mask, reported, 0.0).sum(),
        "is_weight_max": torch.where(mask, reported, -math.inf).max(),
        "is_capped_tokens": capped.sum(),
    }
    return torch.where(mask, weights, 0.0), stats


def host_stats(stats: dict[str, Tensor]) -> dict[str, float]:
    """``grpo_loss_sum``'s stats as numbers, read in one copy; the ratio's extremes only where a token was
    masked in."""
    keys = list(stats)
    values = torch.stack([stats[k].detach().float() for k in keys]).tolist() if keys else []
    out = dict(zip(keys, values, strict=True))
    if not out.get("tokens"):
        out.pop("ratio_max", None)
        out.pop("ratio_min", None)
        out.pop("is_weight_max", None)
    return out


def merge_stats(into: dict[str, float], stats: dict[str, float]) -> None:
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


def step_report(sums: dict[str, float], tokens: int, grad_norm: float, skipped: bool) -> dict[str, float]:
    """What an optimizer step reports from the batch's running ``sums`` (means over its response tokens)."""
    local = max(sums.get("tokens", 0.0), 1.0)
    out = {
        "grad_norm": grad_norm,
        "tokens": float(tokens),
        "loss": sums.get("loss_sum", 0.0) / local,
        "pg_loss": sums.get("pg_loss_sum", 0.0) / local,
        "clip_frac": sums.get("clipped_tokens", 0.0) / local,
        "logprob_mismatch": sums.get("mismatch_sum", 0.0) / local,
        "skipped": float(skipped),
    }
    if "kl_sum" in sums:
        out["kl"] = sums["kl_sum"] / local
    if "is_weight_sum" in sums:
        out["is_weight_mean"] = sums["is_weight_sum"] / local
        out["is_capped_frac"] = sums.get("is_capped_tokens", 0.0) / local
    for key in ("ratio_max", "ratio_min", "is_weight_max"):
        if key in sums:
            out[key] = sums[key]
    return out


class GRPOLoss:
    """Backpropagates GRPO's token-sum loss sample group by sample group; the gradients add up on ``model``.

    With ``compute_dtype=torch.bfloat16`` forward and backward run under
    autocast in bfloat16 over the model's (float32) weights. A sharded
    trainer passes a model whose parameters are DTensors (FSDP2 casts them
    itself) and leaves ``compute_dtype`` alone; nothing here depends on which.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        temperature: float = 1.0,
        ref_model: nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the rollout temperature), got {temperature}")
        self.temperature = temperature
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"train.kl_coef is {cfg.kl_coef} (> 0), which needs a ref_model; none was given")
        self.model = model
        self.cfg = cfg
        self.ref_model = ref_model
        self.compute_dtype = compute_dtype
        self._tokens = 0
        self._stats: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters())
        return p.device if not hasattr(p, "to_local") else p.to_local().device

    @property
    def pending_tokens(self) -> int:
        """Response tokens accumulated since the last step."""
        return self._tokens

    @property
    def pending_stats(self) -> dict[str, float]:
        """Running loss sums since the last step (what a data-parallel group adds up)."""
        return dict(self._stats)

    def discard(self) -> None:
        """Drop the accumulated gradients and sums."""
        self.model.zero_grad(set_to_none=True)
        self._stats, self._tokens = {}, 0

    def _autocast(self) -> Any:
        if self.compute_dtype is None or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

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

    def check(self, samples: list[Sample], advantages: Sequence[float]) -> list[tuple[Sample, float]]:
        """The (sample, advantage) pairs that carry response tokens; a malformed sample is refused here."""
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
        return pairs

    def plan(self, pairs: list[tuple[Sample, float]]) -> list[list[tuple[Sample, float]]]:
        """The micro batches of ``pairs``, bounded in sequences and padded tokens (``train.micro_batch*``)."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s, _ in pairs]
        cut = micro_batches(lengths, self.cfg.micro_batch, self.cfg.micro_batch_tokens)
        return [[pairs[i] for i in mb] for mb in cut]

    def backward(self, chunk: list[tuple[Sample, float]], weight: float = 1.0) -> dict[str, float]:
        """Forward and backward of one micro batch's token-sum loss; its sums, or ``{}`` for a ``weight=0``
        pass (a sharded rank with no samples left runs one so that its collectives match the others')."""
        cfg = self.cfg
        ids, old, mask = self._pack([s for s, _ in chunk])
        adv = torch.tensor([a for _, a in chunk], device=self.device)
        ref = None
        with self._autocast():
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, ids, self.temperature, mask)
            logp = token_logprobs(self.model, ids, self.temperature, mask)
            loss, stats = grpo_loss_sum(
                logp, old, adv, mask, cfg.clip_low, cfg.clip_high, ref, cfg.kl_coef, cfg.recompute_logprobs,
                cfg.correction, cfg.correction_cap,
            )  # fmt: skip
        (loss * weight if weight != 1.0 else loss).backward()
        return host_stats(stats) if weight else {}  # (read once the backward is queued: one sync, after it)

    def accumulate(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Backward the unnormalised loss of these samples; gradients add up until ``step``."""
        stats: dict[str, float] = {}
        for chunk in self.plan(self.check(samples, advantages)):
            merge_stats(stats, self.backward(chunk))
        self.add_stats(stats)
        return stats

    def add_stats(self, stats: dict[str, float]) -> None:
        self._tokens += int(stats.get("tokens", 0))
        merge_stats(self._stats, stats)
