"""What every allocation of one plan asks of the model alike, computed once for the plan.

A plan estimates up to a few hundred allocations of the same work with the same profiles and batch caps;
they differ only in devices per role, so each quantity below is keyed by the one number it depends on."""

from __future__ import annotations

from collections.abc import Callable

from pivotrl.control.messages import Role


class PlanMemo:
    """Per-plan answers: a fresh one for each plan (the work, profiles and batch caps are fixed inside it)."""

    __slots__ = ("_rates", "_tail_steps", "_slowdowns", "_longest")

    def __init__(self) -> None:
        self._rates: dict[tuple[Role, int], float] = {}
        self._tail_steps: dict[int, list[float]] = {}
        self._slowdowns: dict[int, float] = {}
        self._longest: dict[int, float] = {}

    def rate(self, role: Role, devices: int, compute: Callable[[], float]) -> float:
        """Tokens/s of each of ``devices`` devices of ``role`` sharing its work."""
        if (key := (role, devices)) not in self._rates:
            self._rates[key] = compute()
        return self._rates[key]

    def tail_steps(self, devices: int, compute: Callable[[], list[float]]) -> list[float]:
        """Seconds of the rollout's longest sequence to each grid point, its sequences on ``devices``."""
        if devices not in self._tail_steps:
            self._tail_steps[devices] = compute()
        return self._tail_steps[devices]

    def slowdown(self, context: int, compute: Callable[[], float]) -> float:
        """A verdict token's work at ``context`` tokens, relative to one at the judgments' mean context."""
        if context not in self._slowdowns:
            self._slowdowns[context] = compute()
        return self._slowdowns[context]

    def longest(self, count: int, compute: Callable[[], float]) -> float:
        """Seconds the longest of ``count`` fresh judgments takes, alone."""
        if count not in self._longest:
            self._longest[count] = compute()
        return self._longest[count]
