"""The ``Planner``: from demand and profiles, the role of every device from now on, with hysteresis and a
cooldown so that demand oscillating faster than shifts pay off does not make devices flap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pivotrl.control.messages import ROLES, Role
from pivotrl.control.planner.alloc import INF, Alloc, Batch, Move, fmt_alloc, fmt_delta, fmt_seconds
from pivotrl.control.planner.lending import lend, lendable, train_needed
from pivotrl.control.planner.phases import Estimate, PhaseModel
from pivotrl.control.planner.search import Candidate, Scene, candidate, candidate_allocations, moves, pick, search
from pivotrl.control.planner.work import Work, summarize
from pivotrl.control.profiles import Profiles, Workload, _positive


@dataclass(slots=True)
class Decision:
    now: float
    targets: dict[int, Role]
    moves: list[Move]
    reason: str
    before: Estimate | None = None  # the allocation kept as the baseline
    after: Estimate | None = None  # the allocation chosen
    overhead: float = 0.0  # seconds charged for the moves
    wake: float = INF  # when to plan again at the latest: devices lent to the rollout are due in their role

    def row(self) -> dict[str, Any]:
        """The decision as a line of a run's ``decisions.jsonl``: when, the moves, and why."""
        moves = [[dev, src.value if src else None, dst.value] for dev, src, dst in self.moves]
        return {"t": round(self.now, 4), "moves": moves, "reason": self.reason}


class Planner:
    """Decides the role of every device, from demand and profiles, with hysteresis.

    ``hysteresis`` is the relative gain (of the current estimate) a change must
    bring beyond its overhead, ``min_gain_s`` the absolute one; a device that
    moved does not move back to the role it left within ``cooldown_s``.
    """

    def __init__(self, devices: int, hysteresis: float = 0.1, min_gain_s: float = 0.1, cooldown_s: float = 2.0) -> None:
        if devices < 1:
            raise ValueError(f"devices: got {devices}, must be >= 1")
        _positive("hysteresis", hysteresis, strict=False)
        _positive("min_gain_s", min_gain_s, strict=False)
        _positive("cooldown_s", cooldown_s, strict=False)
        self.devices, self.hysteresis, self.min_gain_s, self.cooldown_s = devices, hysteresis, min_gain_s, cooldown_s
        self.log: list[Decision] = []
        self._better_since: float | None = None  # since when some move has beaten keeping by its overhead
        self._left: dict[int, tuple[float, Role | None]] = {}  # device -> (when it last moved, role it left)

    def plan(
        self,
        now: float,
        current: dict[int, Role | None],
        busy: dict[int, int],
        pinned: set[int],
        workload: Workload,
        profiles: Profiles,
        max_batch: Batch,
        judge_kv: float | None = None,
    ) -> Decision:
        """The role of every device from now on. Every split of the devices is a candidate,
        pinned devices keeping theirs; a role may get none even with work left, since
        ``estimate`` hands it the devices of the phase before (or calls it never-ending).
        Devices with no role yet (None) always get one, with no margin to beat. ``judge_kv``:
        tokens a judge device's paged KV cache holds (None: its slots are the only limit)."""
        self._check(current, pinned, max_batch, judge_kv)
        model = PhaseModel(summarize(workload, profiles, judge_kv), profiles, max_batch)
        unassigned = sorted(d for d, r in current.items() if r is None and d not in pinned)
        cands = self._candidates(current, pinned, len(unassigned), model)
        scene = Scene(
            unassigned,
            busy,
            {src: sorted((d for d, r in current.items() if r is src and d not in pinned),
                         key=lambda d: (busy.get(d, 0), d)) for src in ROLES},
            {d: self._barred(d, now) for d in current},
            {Role.ROLLOUT: model.work.rollout.gen_context / profiles.rollout.prefill_rate,
             Role.JUDGE: model.work.judge.context / profiles.judge.prefill_rate, Role.TRAIN: 0.0},
        )  # fmt: skip
        alt, stay = _best(cands, scene)
        chosen, reason = self._choose(alt, stay, model.work, now)
        planned = moves(chosen, scene)
        lent = lendable(planned, current, pinned, model.work.rollout)
        needed = train_needed(chosen, len(lent), model) if lent else 0.0
        planned, wait = lend(planned, lent, needed, profiles.costs)
        if wait < INF:
            reason += f"; devices for train lent to the rollout for {fmt_seconds(wait)}, until needed there"
        targets = {d: r for d, r in current.items() if r is not None}
        for d, _, dst in planned:
            targets[d] = dst
        decision = Decision(now, targets, planned, reason, stay.est, chosen.est, chosen.overhead, now + wait)
        if planned:
            for d, src, _ in planned:
                self._left[d] = (now, src)
            self.log.append(decision)
        return decision

    def _check(
        self, current: dict[int, Role | None], pinned: set[int], max_batch: Batch, judge_kv: float | None
    ) -> None:
        if set(current) != set(range(self.devices)):
            raise ValueError(f"current: names devices {sorted(current)}, expected 0..{self.devices - 1}")
        if not pinned <= set(current):
            raise ValueError(f"pinned: {sorted(pinned - set(current))} are not devices")
        for cap in max_batch if isinstance(max_batch, tuple) else (max_batch,):
            _positive("max_batch", cap)
        if judge_kv is not None:
            _positive("judge_kv", judge_kv)

    @staticmethod
    def _candidates(
        current: dict[int, Role | None], pinned: set[int], unassigned: int, model: PhaseModel
    ) -> list[Candidate]:
        """The allocations worth weighing as candidates, in order of their lower bounds: every split of the
        devices with the pinned ones keeping their roles (searched coarse to fine on many devices)."""
        counts = tuple(sum(1 for r in current.values() if r is role) for role in ROLES)
        floor = tuple(sum(1 for d in pinned if current[d] is role) for role in ROLES)
        movable = {r: sum(1 for d, x in current.items() if x is r and d not in pinned) for r in ROLES}
        made: dict[Alloc, Candidate | None] = {}

        def made_for(alloc: Alloc) -> Candidate | None:
            if alloc not in made:
                made[alloc] = candidate(alloc, counts, unassigned, movable, model)
            return made[alloc]

        def bound(alloc: Alloc) -> float:
            c = made_for(alloc)
            return INF if c is None else c.bound

        total = sum(counts) + unassigned
        cands = [c for a in candidate_allocations(total, floor, counts, bound) if (c := made_for(a)) is not None]
        cands.sort(key=lambda c: (c.bound, c.moved, c.alloc))
        return cands

    def _choose(self, alt: Candidate | None, stay: Candidate, w: Work, now: float) -> tuple[Candidate, str]:
        """Move to ``alt`` (the best allocation that moves a device holding a role) only if
        it beats keeping ``stay`` by its overhead plus the margin; say why either way.

        The margin guards against the estimate's noise, which makes the best alternative flicker
        between plans; a gain that lasts is no noise. So while some move keeps beating its overhead,
        plan after plan, the margin shrinks: it is gone once such gains have lasted as many seconds
        as the margin is long (a tenth of the step's rest, by default), and a move that wins by
        half the margin is taken after half that wait."""
        why = situation(stay.est, w)
        base = stay.total
        if alt is None:
            self._better_since = None
            return stay, f"{why}: keep {fmt_alloc(stay.alloc)}, est {fmt_seconds(base)}; no device can move"
        gain = base - alt.est.total
        margin = max(self.hysteresis * base, self.min_gain_s) if base < INF else 0.0
        held = ""
        if base < INF and alt.total < INF and gain > alt.overhead + self.min_gain_s:
            since = now if self._better_since is None else self._better_since
            self._better_since = since
            if now > since:
                margin = max(self.min_gain_s, margin - (now - since))
                held = f" (held {fmt_seconds(now - since)})"
        else:
            self._better_since = None
        if alt.total < INF and (base == INF or gain > alt.overhead + margin):
            self._better_since = None
            return alt, (
                f"{why}: est {fmt_seconds(base)} -> {fmt_seconds(alt.est.total)} with "
                f"{fmt_delta(stay.alloc, alt.alloc)}; gain {fmt_seconds(gain)} > migration "
                f"{fmt_seconds(alt.overhead)} + margin {fmt_seconds(margin)}{held}"
            )
        return stay, (
            f"{why}: keep {fmt_alloc(stay.alloc)}, est {fmt_seconds(base)}; best move {fmt_alloc(alt.alloc)} "
            f"est {fmt_seconds(alt.est.total)}, gain {fmt_seconds(gain)} <= migration {fmt_seconds(alt.overhead)} "
            f"+ margin {fmt_seconds(margin)}{held}"
        )

    def _barred(self, device: int, now: float) -> Role | None:
        """The role ``device`` may not go back to yet (anti-flapping), if any."""
        when, left = self._left.get(device, (-INF, None))
        return left if now - when < self.cooldown_s else None


def _best(cands: list[Candidate], scene: Scene) -> tuple[Candidate | None, Candidate]:
    """The best allocation that moves a device holding a role (None: none can), and the best that keeps them."""
    best, stay = search(cands, scene)
    if best.total == INF and any(scene.barred.values()):
        # the cooldown must never stall a step: when no allowed allocation can finish it,
        # devices may go back to roles they just left
        scene = Scene(scene.unassigned, scene.busy, scene.orders, {}, scene.reprefill)
        best, stay = search(cands, scene)
    if best is not stay:
        return best, stay
    for c in sorted(cands, key=lambda c: (c.est.total, c.bound, c.moved, c.alloc)):
        # the best alternative, to say in the log what keeping saved
        if c.moves_a_role and (c.picked or pick(c, scene)):
            return c, stay
    return None, stay


def situation(est: Estimate, w: Work) -> str:
    """What the current allocation waits on, for the decision log."""
    if w.rollout.seqs and est.tail:
        return f"rollout tail: {w.rollout.seqs} seqs, longest ~{w.rollout.longest:.0f} tokens left"
    if w.rollout.seqs:
        return f"rollout: {w.rollout.seqs} seqs, ~{w.rollout.tokens:.0f} tokens left"
    if w.judge.items:
        return f"judge backlog: {w.judge.items} judgments"
    if w.train.groups:
        return f"train: {w.train.groups} groups left"
    return "idle"
