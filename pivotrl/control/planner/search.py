"""The search over allocations: which splits of the devices a plan weighs, what each costs with the devices
that would move (their shifts, the requests they migrate), and which is best."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pivotrl.control.messages import ROLES, Role
from pivotrl.control.planner.alloc import INF, Alloc, Late, Move
from pivotrl.control.planner.phases import Estimate, PhaseModel
from pivotrl.control.planner.work import summarize
from pivotrl.control.profiles import Profiles, ShiftCosts, Workload, _positive

EXHAUSTIVE_UP_TO = 32  # devices; beyond, allocations are searched coarse to fine
COARSE = 12  # grid points per axis of a cluster's allocations
FINE = 3  # devices around the grid's best searched one by one

Flows = dict[tuple[Role | None, Role], int]  # devices moving (from, to); from None: a device with no role yet
Take = tuple[Role, dict[Role, int], list[tuple[int, Role]] | None]  # role, its slots, the devices (None: the first)


def allocations(devices: int, floor: Alloc) -> Iterator[Alloc]:
    """Every split of ``devices`` over the roles with at least ``floor`` devices each."""
    for n_r in range(floor[0], devices - floor[1] - floor[2] + 1):
        for n_g in range(floor[1], devices - n_r - floor[2] + 1):
            yield n_r, n_g, devices - n_r - n_g


def candidate_allocations(devices: int, floor: Alloc, counts: Alloc, total: Callable[[Alloc], float]) -> list[Alloc]:
    """Every allocation for a few devices. For many (a cluster's instances), a grid of
    about ``COARSE`` x ``COARSE`` allocations, then every allocation within half a grid cell
    (at most ``FINE`` devices) of the grid's best and within one device of the current one:
    about 150 estimates instead of ``devices^2 / 2`` on every plan."""
    if devices <= EXHAUSTIVE_UP_TO:
        return list(allocations(devices, floor))
    k = -(-devices // COARSE)

    def axis(lo: int, hi: int) -> list[int]:
        return sorted({*range(lo, hi + 1, k), hi}) if hi >= lo else []

    grid = [
        (r, g, devices - r - g)
        for r in axis(floor[0], devices - floor[1] - floor[2])
        for g in axis(floor[1], devices - r - floor[2])
    ]
    best = min(grid, key=total)
    out = set(grid)
    for (cr, cg, _), radius in ((best, min(max(1, k // 2), FINE)), (counts, 1)):
        for r in range(max(floor[0], cr - radius), cr + radius + 1):
            for g in range(max(floor[1], cg - radius), cg + radius + 1):
                if devices - r - g >= floor[2]:
                    out.add((r, g, devices - r - g))
    return sorted(out)


def initial_split(workload: Workload, profiles: Profiles, devices: int, max_batch: int) -> dict[Role, int]:
    """The best allocation from scratch (no shift charged): the start split ``pivotrl plan``
    recommends. Ties go to more rollout devices, then more judge devices."""
    _positive("devices", devices)
    model = PhaseModel(summarize(workload, profiles), profiles, max_batch)
    best = min(allocations(devices, (0, 0, 0)), key=lambda a: (model.estimate(a).total, -a[0], -a[1]))
    return dict(zip(ROLES, best, strict=True))


@dataclass(slots=True)
class Candidate:
    """An allocation a plan weighs, with the devices that would move to reach it."""

    bound: float  # the estimate before migrations: a lower bound of total
    moved: int
    alloc: Alloc
    flows: Flows
    est: Estimate
    shift: float  # the slowest of the shifts, which run in parallel
    total: float = INF
    overhead: float = 0.0
    picked: bool = False  # devices chosen (``takes``); the moves are listed only for the one kept
    takes: list[Take] = field(default_factory=list)

    def key(self) -> tuple[float, int, Alloc]:
        return self.total, self.moved, self.alloc

    @property
    def moves_a_role(self) -> bool:
        """Some device that holds a role leaves it (not only devices with none taking one)."""
        return any(s is not None for s, _ in self.flows)


def flows(counts: Alloc, unassigned: int, alloc: Alloc) -> Flows:
    """Devices moving (from, to) to get from ``counts`` to ``alloc``: unassigned ones
    fill the roles short of devices first, then surplus roles give theirs. With
    three roles the rest is determined."""
    need = {r: max(0, a - c) for r, a, c in zip(ROLES, alloc, counts, strict=True)}
    give = {r: max(0, c - a) for r, a, c in zip(ROLES, alloc, counts, strict=True)}
    out: Flows = {}
    for src, pool in ((None, unassigned), *give.items()):
        for dst in ROLES:
            k = min(pool, need[dst])
            if k:
                out[(src, dst)] = k
                need[dst] -= k
                pool -= k
    return out


def late_arrivals(moving: Flows, costs: ShiftCosts) -> Late:
    """Per role, the devices ``moving`` brings in and when the slowest of their shifts ends."""
    late = [[0, 0.0] for _ in ROLES]
    for (src, dst), k in moving.items():
        slot = late[ROLES.index(dst)]
        slot[0] += k
        slot[1] = max(slot[1], costs.cost(src, dst))
    return tuple((k, at) for k, at in late)


def candidate(
    alloc: Alloc, counts: Alloc, unassigned: int, movable: dict[Role, int], model: PhaseModel
) -> Candidate | None:
    """``alloc`` as a candidate (None if it moves more devices of a role than may move), its
    moved devices joining their role after their shift."""
    moving = flows(counts, unassigned, alloc)
    gives = Counter[Role]()
    for (src, _), k in moving.items():
        if src is not None:
            gives[src] += k
    if any(k > movable[r] for r, k in gives.items()):
        return None
    late = late_arrivals(moving, model.profiles.costs)
    est = model.estimate(alloc, late)
    shift = max((at for _, at in late), default=0.0)
    return Candidate(est.total, sum(moving.values()), alloc, moving, est, shift)


@dataclass(slots=True)
class Scene:
    """What choosing devices for a candidate needs, computed once per plan."""

    unassigned: list[int]  # devices without a role, in order
    busy: dict[int, int]  # requests in flight per device
    orders: dict[Role, list[int]]  # movable devices of each role, least loaded first
    barred: dict[int, Role | None]  # the role each device may not go back to yet
    reprefill: dict[Role, float]  # seconds re-prefilling one request migrating from each role
    unbarred: dict[Role, int] = field(init=False)  # how many of each order come before the first barred
    prefix_busy: dict[Role, list[int]] = field(init=False)  # requests in flight on the first k of each order

    def __post_init__(self) -> None:
        self.unbarred, self.prefix_busy = {}, {}
        for role, order in self.orders.items():
            self.unbarred[role] = next((i for i, d in enumerate(order) if self.barred.get(d)), len(order))
            sums = [0]
            for d in order:
                sums.append(sums[-1] + self.busy.get(d, 0))
            self.prefix_busy[role] = sums


def search(cands: list[Candidate], scene: Scene) -> tuple[Candidate, Candidate]:
    """The best candidate and the best that moves no device holding a role (``stay``),
    in order of their lower bounds, stopping once no later one can beat both."""
    best = stay = None
    for c in cands:
        if best is not None and stay is not None and c.bound > max(best.total, stay.total):
            break
        if not pick(c, scene):
            continue
        if best is None or c.key() < best.key():
            best = c
        if not c.moves_a_role and (stay is None or c.key() < stay.key()):
            stay = c
    if best is None or stay is None:  # cannot happen: keeping every role is always feasible
        raise AssertionError("planner: no feasible allocation")
    return best, stay


def pick(c: Candidate, scene: Scene) -> bool:
    """Which devices make the candidate's moves: the least loaded, so the fewest
    sequences migrate, and none that would go back to a role it left within
    the cooldown. Sets the overhead (the slowest shift, plus the migrated
    requests' re-prefill shared by the devices that stay in their role);
    False if impossible. When none of the
    least loaded devices is barred they are simply the first of each role's
    order, priced from prefix sums without listing them (a cluster's plans
    weigh hundreds of candidates moving tens of devices)."""
    migrate, takes = 0.0, []
    for src in ROLES:
        slots = {dst: k for (s, dst), k in c.flows.items() if s is src}
        if not slots:
            continue
        k = sum(slots.values())
        if k <= scene.unbarred[src]:
            takes.append((src, slots, None))
            requests = scene.prefix_busy[src][k]
        else:
            chosen = take(scene.orders[src], slots, scene.barred.get)
            if chosen is None:
                return False
            takes.append((src, slots, chosen))
            requests = sum(scene.busy.get(d, 0) for d, _ in chosen)
        # the devices staying in the role re-prefill the migrated requests side by side
        stay = max(1, c.alloc[ROLES.index(src)])
        migrate += requests * scene.reprefill[src] / stay
    c.takes, c.picked = takes, True
    c.overhead = migrate
    c.total = c.est.total + c.overhead
    return True


def moves(c: Candidate, scene: Scene) -> list[Move]:
    """The moves of a picked candidate, device by device."""
    fresh = iter(scene.unassigned)
    out: list[Move] = [(next(fresh), None, dst) for (src, dst), k in c.flows.items() if src is None for _ in range(k)]
    for src, slots, chosen in c.takes:
        if chosen is None:
            order = iter(scene.orders[src])
            chosen = [(next(order), dst) for dst, k in slots.items() for _ in range(k)]
        out += [(d, src, dst) for d, dst in chosen]
    return sorted(out, key=lambda m: m[0])


def take(
    order: list[int], slots: dict[Role, int], barred: Callable[[int], Role | None]
) -> list[tuple[int, Role]] | None:
    """The cheapest devices (in ``order``) to fill ``slots`` (destination -> count), where a
    device may not go to its barred role. Greedy is optimal here: the constraints only cap
    how many devices barred from each destination may be taken (a partition matroid)."""
    total = sum(slots.values())
    chosen: list[int] = []
    capped = Counter[Role]()
    for d in order:
        if len(chosen) == total:
            break
        bar = barred(d)
        if bar in slots:
            if capped[bar] + 1 > total - slots[bar]:
                continue
            capped[bar] += 1
        chosen.append(d)
    if len(chosen) < total:
        return None
    return _assign(chosen, slots, barred)


def _assign(chosen: list[int], slots: dict[Role, int], barred: Callable[[int], Role | None]) -> list[tuple[int, Role]]:
    """A destination for each of ``chosen``: a barred device the one it may take, the others what is left."""
    left = dict(slots)
    out: list[tuple[int, Role]] = []
    flexible = []
    for d in chosen:
        bar = barred(d)
        if bar in slots:  # with two destinations, the other one; with one, never taken
            dst = next(r for r in slots if r is not bar)
            left[dst] -= 1
            out.append((d, dst))
        else:
            flexible.append(d)
    for d in flexible:
        dst = next(r for r in slots if left[r] > 0)
        left[dst] -= 1
        out.append((d, dst))
    return out
