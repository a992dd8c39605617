"""The decoder's attention: grouped query heads over fewer key heads."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_heads_attend_alike_with_keys_repeated_per_head(masked):
    """Where CUDA would give grouped-query attention SDPA's math kernel, the keys and values are repeated per
    query head instead: the same attention, each key head serving its run of query heads."""
    from pivotrl.model.decoder import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=gen) for h in (6, 2, 2))
    kwargs = {"attn_mask": torch.rand(2, 1, 5, 5, generator=gen) > 0.3} if masked else {"is_causal": True}
    if masked:
        kwargs["attn_mask"][..., 0] = True  # (every query sees a key)
    grouped, repeated = attend(q, k, v, expand=False, **kwargs), attend(q, k, v, expand=True, **kwargs)
    assert torch.allclose(grouped, repeated, atol=1e-6)
    assert not torch.allclose(attend(q, k.flip(1), v.flip(1), expand=True, **kwargs), grouped, atol=1e-3)
