"""The fluid model of a phase: work done by devices that join over time, each at a rate that may depend on
how many share the work. Devices are alike and work is divisible, so an answer is a time, not a schedule."""

from __future__ import annotations

from collections.abc import Callable

from pivotrl.control.planner.alloc import INF

Arrivals = list[tuple[float, int]]  # (time, devices joining then)
Pieces = list[tuple[float, float]]  # (release time, amount of work)


def drain(work: float, per_device: Callable[[int], float], arrivals: Arrivals) -> float:
    """Fluid completion time of ``work`` when devices join at the given times;
    ``per_device(n)`` is the rate of each of ``n`` devices sharing the work."""
    if work <= 0:
        return 0.0
    t, n, left = 0.0, 0, work
    for at, k in sorted(arrivals):
        if k <= 0 or at == INF:
            continue
        if n:
            rate = n * per_device(n)
            if t + left / rate <= at:
                return t + left / rate
            left -= rate * (at - t)
        t, n = at, n + k
    return t + left / (n * per_device(n)) if n else INF


def fluid(work: Pieces, arrivals: Arrivals, rate: float) -> float:
    """When work released at ``work`` (time, amount) is done by devices joining at ``arrivals``
    (time, count), each doing ``rate`` per second: the fluid model of ``drain`` with work that
    is not all there from the start. (Devices are alike, so the work's order does not matter:
    first in first out is as fast as any.)"""
    pieces = sorted((at, x) for at, x in work if x > 0)
    return fifo(pieces, arrivals, lambda n: rate)[-1] if pieces else 0.0


def fifo(work: Pieces, arrivals: Arrivals, per_device: Callable[[int], float]) -> list[float]:
    """When each piece of work (release time, amount; in release order) is done, first in first
    out, by devices joining at ``arrivals``, each of ``n`` doing ``per_device(n)`` per second:
    ``drain``'s fluid model with work released over time, each piece's end kept (inf: never)."""
    out = [INF] * len(work)
    joins = sorted((at, k) for at, k in arrivals if k > 0 and at < INF)
    now, n, j = 0.0, 0, 0
    for i, (at, left) in enumerate(work):
        now = max(now, at)  # the pieces before are done: devices idle until this one comes
        while True:
            while j < len(joins) and joins[j][0] <= now:
                n += joins[j][1]
                j += 1
            nxt = joins[j][0] if j < len(joins) else INF
            rate = n * per_device(n) if n else 0.0
            if left <= 0 or (rate > 0 and now + left / rate <= nxt):
                now += left / rate if left > 0 else 0.0
                break
            if nxt == INF:
                return out
            left -= rate * (nxt - now)
            now = nxt
        out[i] = now
    return out


def left_at(work: Pieces, arrivals: Arrivals, per_device: Callable[[int], float], at: float) -> float:
    """Work still undone at ``at`` of ``fifo``'s (the same pieces, devices and rates)."""
    points = sorted({t for t, _ in work if t <= at} | {t for t, k in arrivals if k > 0 and t <= at} | {at})
    left, now, n = 0.0, 0.0, 0
    for t in points:
        if n and left > 0:
            left = max(0.0, left - n * per_device(n) * (t - now))
        now = t
        left += sum(x for r, x in work if r == t)
        n += sum(k for r, k in arrivals if r == t and k > 0)
    return left
