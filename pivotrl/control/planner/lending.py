"""Lending: devices a plan puts in train generate for the rollout until the trainer needs them there.

The estimate holds a role's devices from now until its phase ends, so moving now is the only way it can
see them train before the rollout ends; it cannot see them generate in the meantime. Lending fills that gap:
a plan's train devices that would idle until the first groups are judged are lent to the rollout, and due
back in train by the latest time that leaves the plan's estimate as it is."""

from __future__ import annotations

from pivotrl.control.messages import Role
from pivotrl.control.planner.alloc import INF, Move
from pivotrl.control.planner.phases import PhaseModel
from pivotrl.control.planner.search import Candidate, late_arrivals
from pivotrl.control.planner.work import RolloutWork
from pivotrl.control.profiles import ShiftCosts

LEND_AFTER = 2.0  # round trips of shifts a train device must be able to generate for, to be lent


def lendable(moves: list[Move], current: dict[int, Role | None], pinned: set[int], rollout: RolloutWork) -> list[Move]:
    """The devices a plan has in train that could generate for now instead: those it moves there, and,
    when sequences wait for a device, those idle there (otherwise they would only take sequences from
    the others), as the moves that would put them on the rollout. None once the rollout is done."""
    if not rollout.seqs:
        return []
    out: list[Move] = [(d, src, src or Role.ROLLOUT) for d, src, dst in moves if dst is Role.TRAIN]
    if rollout.queued:
        moving = {d for d, _, _ in moves}
        out += [(d, Role.TRAIN, Role.ROLLOUT) for d, r in current.items()
                if r is Role.TRAIN and d not in pinned and d not in moving]  # fmt: skip
    return out


def train_needed(c: Candidate, lent: int, model: PhaseModel) -> float:
    """Seconds from now by which ``lent`` of the candidate's train devices must be in train: the
    latest arrival that leaves its estimate as it is (the groups they will train are not judged yet),
    never before the first group can train."""
    if c.est.train_from == INF:
        return 0.0
    late = list(late_arrivals(c.flows, model.profiles.costs))
    base, first = c.est.total, max(late[2][1], c.est.train_from)

    def total(at: float) -> float:
        late[2] = (lent, at)
        return model.estimate(c.alloc, tuple(late)).total

    slack = 1e-6 * max(1.0, base)
    if base == INF or total(first) > base + slack:
        return first
    lo, hi = first, base  # total(lo) holds; by ``base`` the step would be over
    if total(hi) <= base + slack:
        return hi
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= base + slack else (lo, mid)
    return lo


def lend(moves: list[Move], lendable: list[Move], needed: float, costs: ShiftCosts) -> tuple[list[Move], float]:
    """The plan's moves, with the devices it has in train lent to the rollout until they are ``needed``
    there: until then they would idle, while the rollout ends sooner with them. ``lendable`` (from
    ``lendable``) says how: a device the plan takes out of the rollout or the judge for train stays
    where it is, one with no role yet starts on the rollout, an idle train device joins the rollout.
    Only if they can generate for ``LEND_AFTER`` round trips of shifts; also the seconds until they
    must leave for train (inf: none lent)."""
    to_train, back = costs.cost(Role.ROLLOUT, Role.TRAIN), costs.cost(Role.TRAIN, Role.ROLLOUT)
    wait = needed - to_train  # a device in train now would idle this long
    if not lendable or wait <= LEND_AFTER * (to_train + back):
        return moves, INF
    lent = {d for d, _, _ in lendable}
    kept = [m for m in moves if m[0] not in lent]
    return sorted(kept + [m for m in lendable if m[1] != m[2]], key=lambda m: m[0]), wait
