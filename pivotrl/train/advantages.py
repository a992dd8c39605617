"""GRPO group advantages: pure Python, so the control plane computes them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages: each reward relative to the other responses to the same prompt.

    ``rewards`` holds consecutive groups of ``group_size``. The std is the
    population std (ddof=0): the group is all the responses to the prompt, not
    a sample from a larger set, and with ddof=0 a group's advantages have unit
    RMS whatever its size (ddof=1 would shrink small groups, e.g. +-0.71
    instead of +-1 for a group of two). A group with equal rewards carries no
    signal and gets exactly 0.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        if max(group) == min(group):
            out.extend([0.0] * group_size)
            continue
        mean = sum(group) / group_size
        centred = [r - mean for r in group]
        if scale_by_std:
            std = math.sqrt(sum(c * c for c in centred) / group_size)
            centred = [c / (std + eps) for c in centred]
        out.extend(centred)
    return out
