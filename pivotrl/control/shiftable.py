"""Shiftable mode: the planner moves devices between roles while a step runs.

The policy owns the planner and its profiles. The controller shows it every
event (``observe``) so the profiles learn throughput per role, response
lengths and shift costs online, and asks for targets with a ``PlanView`` of
the step: what is left, who holds which role, who is pinned (holding
gradients, shifting, in the optimizer step). A device whose target changes
while it serves requests leaves at once: its sequences migrate.
"""

from __future__ import annotations

from dataclasses import dataclass

from pivotrl.control.messages import Accumulated, Event, Generated, Progress, Role, ShiftDone
from pivotrl.control.modes import Demand
from pivotrl.control.planner import LengthModel, Planner, Profiles, RoleProfile, ShiftCosts, Workload


@dataclass(slots=True, frozen=True)
class PlanView:
    """What the planner needs beyond the demand counts."""

    now: float
    roles: tuple[Role | None, ...]
    pinned: frozenset[int]
    workload: Workload


class Shiftable:
    name = "shiftable"
    preempt = True
    wants_view = True

    def __init__(self, devices: int, max_batch: int, rollout_tokens: int, judge_tokens: int) -> None:
        if devices < 1:
            raise ValueError(f"shiftable needs at least 1 device, got {devices}")
        self.devices, self.max_batch = devices, max_batch
        self.planner = Planner(devices)
        # rough priors, of the order of one CPU thread on the bundled models; the first measured
        # slices of each role replace them (EWMA)
        self.profiles = Profiles(
            rollout=RoleProfile(device_rate=4000.0, seq_rate=300.0),
            judge=RoleProfile(device_rate=4000.0, seq_rate=300.0),
            train=RoleProfile(device_rate=3000.0, seq_rate=300.0),
            lengths=LengthModel(prior_mean=rollout_tokens / 2, prior_max=float(rollout_tokens)),
            costs=ShiftCosts(),
        )
        self.judge_tokens = float(judge_tokens)
        self._train: tuple[int, ...] = ()

    def observe(self, event: Event, previous_role: Role | None) -> None:
        p = self.profiles
        if isinstance(event, Progress) and event.tokens and event.seconds > 0:
            profile = p.rollout if event.role is Role.ROLLOUT else p.judge
            profile.observe(event.tokens, event.seconds, max(1, event.running))
            p.costs.observe_prefill(event.prefill_tokens, event.prefill_seconds)
        elif isinstance(event, Generated):
            for r in event.results:
                p.lengths.observe(len(r.output_ids))
        elif isinstance(event, Accumulated) and event.tokens and event.seconds > 0:
            p.train.observe(event.tokens, event.seconds, max(1, event.samples))
        elif isinstance(event, ShiftDone) and event.seconds > 0:
            p.costs.observe(previous_role, event.role, event.seconds)

    def targets(self, demand: Demand) -> dict[int, Role]:
        view = demand.view
        assert isinstance(view, PlanView), "shiftable mode needs the controller's plan view"
        decision = self.planner.plan(
            view.now,
            dict(enumerate(view.roles)),
            dict(enumerate(demand.loads)),
            set(view.pinned),
            view.workload,
            self.profiles,
            self.max_batch,
        )
        self._train = tuple(d for d, r in sorted(decision.targets.items()) if r is Role.TRAIN)
        return decision.targets

    def train_devices(self) -> tuple[int, ...]:
        return self._train
