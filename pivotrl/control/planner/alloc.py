"""The planner's vocabulary: allocations (devices per role), moves, late arrivals, and their short forms."""

from __future__ import annotations

import math

from pivotrl.control.messages import ROLES, Role

INF = math.inf
Alloc = tuple[int, int, int]  # devices on rollout, judge, train (the order of ``ROLES``)
Move = tuple[int, Role | None, Role]  # device, role it leaves (None: it had none), role it takes
Batch = int | tuple[int, int]  # sequences one device runs at once: for both roles, or (rollout, judge)
Late = tuple[tuple[int, float], ...]  # per role (ROLES order): devices of the allocation still to arrive, and when
ON_TIME: Late = ((0, 0.0), (0, 0.0), (0, 0.0))


def fmt_seconds(seconds: float) -> str:
    """``1.25s``, or ``inf`` for a phase that never ends."""
    return f"{seconds:.2f}s" if seconds < INF else "inf"


def fmt_alloc(alloc: Alloc | dict[Role, int]) -> str:
    """``r3 j1 t0``: the short form used in decision reasons and ``pivotrl plan``."""
    counts = tuple(alloc[r] for r in ROLES) if isinstance(alloc, dict) else alloc
    return " ".join(f"{r.value[0]}{n}" for r, n in zip(ROLES, counts, strict=True))


def fmt_delta(before: Alloc, after: Alloc) -> str:
    """``rollout-2 train+2``: the roles an allocation changes, by how many devices."""
    parts = [f"{r.value}{b - a:+d}" for r, a, b in zip(ROLES, before, after, strict=True) if b != a]
    return " ".join(parts)
