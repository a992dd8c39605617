"""How many sequences a generation engine's KV cache holds: tokens from a memory budget.

The native engine's cache is slotted: every slot holds one sequence of up to
``max_len`` tokens, so its size is ``slots x max_len x bytes_per_token``. The
number of slots is what a budget decides: as many as ``rollout.max_batch``
asks for, fewer when the budget holds fewer, and an error naming the key when
it cannot hold even one sequence of ``max_len`` tokens (the smallest cache a
request can run in).

The budget comes from ``rollout.kv_cache_gb``: a fixed number of bytes per
device, or (0, auto) nothing on a CPU, where host memory is not the limit and
the cache is ``max_batch`` slots as before, and on a GPU a fraction of the
memory this device may still take once its weights are loaded
(:func:`auto_budget`). The fraction leaves room for what generation allocates
beside the cache (prefill activations, attention scores, logits, the
allocator's slack).

Pure arithmetic, no device calls: the engine passes the numbers in, so every
case is tested on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pivotrl.errors import UserError
from pivotrl.model.config import ModelConfig

KEY = "rollout.kv_cache_gb"  # the config key that sets the budget; errors name it
GB = 10**9
AUTO_FRACTION = 0.85  # of the memory left after the weights, on a GPU, when the budget is auto


class KVBudgetError(UserError):
    """The model's weights plus the smallest useful KV cache do not fit the budget or the device."""


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The cache an engine allocates: ``slots`` sequences of ``max_len`` tokens."""

    slots: int
    max_len: int
    bytes_per_token: int
    budget_bytes: int | None  # None: no budget (CPU, auto), slots = max_batch

    @property
    def nbytes(self) -> int:
        return self.slots * self.max_len * self.bytes_per_token

    @property
    def tokens(self) -> int:
        return self.slots * self.max_len


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item


def auto_budget(free_bytes: int, total_bytes: int, held_bytes: int, share: float = 1.0) -> int:
    """The auto budget on a GPU: :data:`AUTO_FRACTION` of what this device may still take.

    ``free_bytes`` is what the GPU has free (including what this process's
    allocator caches but does not use), ``held_bytes`` what this device holds
    already (its weights), ``share`` its share of the GPU when several device
    actors share one (it may not take the others' part, even while it is free).
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    may_take = min(free_bytes, int(share * total_bytes) - held_bytes)
    return max(0, int(AUTO_FRACTION * may_take))


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Bytes a device gives its KV cache, and where the number came from (for the error message).

    ``nbytes`` None means no budget: the cache holds ``max_batch`` sequences.
    """

    nbytes: int | None = None
    explicit: bool = False  # the user's rollout.kv_cache_gb (else: the auto budget of a GPU)
    weights_bytes: int = 0  # what the device holds besides the cache, for the message

    def plan(self, cfg: ModelConfig, dtype: torch.dtype, max_len: int, max_batch: int) -> KVPlan:
        """Slots for sequences of ``max_len`` tokens: ``max_batch``, or fewer if the budget holds fewer."""
        if max_len < 1 or max_batch < 1:
            raise ValueError(f"max_len and max_batch must be >= 1, got {max_len} and {max_batch}")
        per_token = bytes_per_token(cfg, dtype)
        if self.nbytes is None:
            return KVPlan(max_batch, max_len, per_token, None)
        per_seq = per_token * max_len
        slots = min(max_batch, self.nbytes // per_seq)
        if slots < 1:
            source = (
                f"{KEY}={self.nbytes / GB:g}"
                if self.explicit
                else f"{KEY}=0 (auto: {AUTO_FRACTION:g} of the device memory left after the weights)"
            )
            raise KVBudgetError(
                f"{KEY}: the model's weights ({self.weights_bytes / GB:.3g} GB) and the smallest useful KV cache "
                f"(one sequence of {max_len} tokens, {per_seq / GB:.3g} GB in {str(dtype).removeprefix('torch.')}) "
                f"do not fit: {source} gives a KV budget of {self.nbytes / GB:.3g} GB. Allowed: a budget of at "
                f"least {per_seq / GB:.3g} GB that the device can hold; or shorter sequences "
                "(rollout.max_new_tokens, judge.max_new_tokens), a smaller rollout copy "
                "(policy.rollout_dtype=bfloat16) or more memory per device"
            )
        return KVPlan(slots, max_len, per_token, self.nbytes)


def check_fits(plan: KVPlan, free_bytes: int, weights_bytes: int = 0) -> None:
    """An explicit budget the device cannot hold is the user's mistake too: say so before allocating."""
    if plan.nbytes > free_bytes:
        raise KVBudgetError(
            f"{KEY}={(plan.budget_bytes or 0) / GB:g}: a KV cache of {plan.slots} sequences x {plan.max_len} tokens "
            f"needs {plan.nbytes / GB:.3g} GB but the device has {free_bytes / GB:.3g} GB free after the weights "
            f"({weights_bytes / GB:.3g} GB). Allowed: a budget the device can hold (at most {free_bytes / GB:.3g}), "
            "or 0 (auto)"
        )
