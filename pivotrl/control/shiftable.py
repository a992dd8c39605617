"""Shiftable mode: the planner moves devices between roles while a step runs.

The policy owns the planner and its profiles. The controller shows it every
event (``observe``) so the profiles learn throughput per role, response
lengths and shift costs online, and asks for targets with a ``PlanView`` of
the step: what is left, who holds which role, who is pinned (holding
gradients, shifting, in the optimizer step). A device whose target changes
while it serves requests leaves at once: its sequences migrate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pivotrl.control.messages import Accumulated, Event, Generated, Judged, Progress, Role, ShiftDone, Trained
from pivotrl.control.modes import Demand
from pivotrl.control.planner import Planner
from pivotrl.control.profiles import LengthModel, Profiles, RoleProfile, ShiftCosts, TrainProfile, Workload

Layout = tuple[tuple[Role | None, ...], frozenset[int]]  # the role of every device, the devices pinned to theirs


class PlanView:
    """What the planner needs beyond the demand counts. The layout (it walks every device)
    and the workload (every running sequence) may each be given as a function, called on
    first use, so a policy that does not re-plan on an event does not pay for them."""

    __slots__ = ("now", "_layout", "_workload")

    def __init__(
        self, now: float, layout: Layout | Callable[[], Layout], workload: Workload | Callable[[], Workload]
    ) -> None:
        self.now, self._layout, self._workload = now, layout, workload

    @property
    def roles(self) -> tuple[Role | None, ...]:
        return self._get_layout()[0]

    @property
    def pinned(self) -> frozenset[int]:
        return self._get_layout()[1]

    def _get_layout(self) -> Layout:
        if callable(self._layout):
            self._layout = self._layout()
        return self._layout

    @property
    def workload(self) -> Workload:
        if callable(self._workload):
            self._workload = self._workload()
        return self._workload


REPLAN_SHARE = 0.01  # re-plan at the latest after this share of the step's estimated rest
# the same beyond EXACT_UP_TO devices, where a plan weighs hundreds of allocations: larger, since plans cost
# wall time there, and small enough that a change of demand is still met within a few percent of the step
REPLAN_SHARE_CLUSTER = 0.04
EXACT_UP_TO = 32  # devices; beyond, only a phase change or the timer triggers a plan (some device always moves)


class Shiftable:
    name = "shiftable"
    preempt = True
    wants_view = True

    def __init__(
        self, devices: int, max_batch: int, rollout_tokens: int, judge_tokens: int, step_samples: int = 0
    ) -> None:
        if devices < 1:
            raise ValueError(f"shiftable needs at least 1 device, got {devices}")
        self.devices = devices
        self.max_batch: int | tuple[int, int] = max_batch  # sequences a device runs at once: both roles, or each
        self.judge_kv: int | None = None  # tokens a judge device's paged KV cache holds (None: fixed slots)
        self.planner = Planner(devices)
        # rough priors, of the order of one CPU thread on the bundled models; the first measured
        # slices of each role replace them (EWMA)
        self.profiles = Profiles(
            rollout=RoleProfile.from_rates(seq_rate=300.0, device_rate=4000.0),
            judge=RoleProfile.from_rates(seq_rate=300.0, device_rate=4000.0),
            train=TrainProfile(device_rate=3000.0),
            # lengths of the last step's worth of responses: mid-step, the short ones of this step and
            # the long ones that ended the last, together about one whole step. A shorter window
            # would hold the responses that finish first, biased short, or last, biased long
            lengths=LengthModel(
                prior_mean=rollout_tokens / 2, prior_max=float(rollout_tokens), window=max(step_samples, 4096)
            ),
            costs=ShiftCosts(),
            judgments=LengthModel(
                prior_mean=judge_tokens / 2, prior_max=float(judge_tokens), window=max(step_samples, 4096)
            ),
        )
        self.judge_tokens = float(judge_tokens)
        self._train: tuple[int, ...] = ()
        self._horizon = 0.0  # the step's estimated length, as the recent plans saw it (decaying maximum)
        self._last: tuple[tuple, float, float, dict[int, Role]] | None = None  # (situation, when, next due, targets)

    def state(self) -> dict[str, Any]:
        """What the planner learned (a checkpoint keeps it)."""
        return self.profiles.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.profiles.restore(state)

    def observe(self, event: Event, previous_role: Role | None) -> None:
        p = self.profiles
        if isinstance(event, Progress):
            profile = p.rollout if event.role is Role.ROLLOUT else p.judge
            profile.observe_prefill(event.prefill_tokens, event.prefill_seconds)  # prices reading prompts, migrations
            decode = event.seconds - event.prefill_seconds
            if event.tokens and decode > 0:
                # the mean context of its decode steps, where the runtime counts what they read
                context = event.kv_tokens / event.tokens if event.kv_tokens else None
                if event.steps:  # the mean batch of its decode steps (the batch it started with overstates it)
                    profile.observe(event.tokens, decode, event.tokens / event.steps, context)
                elif not event.prefill_seconds:  # a runtime that does not count its steps
                    profile.observe(event.tokens, event.seconds, max(1, event.running), context)
        elif isinstance(event, Generated):
            for r in event.results:
                p.lengths.observe(len(r.output_ids))
        elif isinstance(event, Judged):
            for j in event.results:
                p.judgments.observe(j.tokens)
        elif isinstance(event, Accumulated) and event.tokens and event.seconds > 0:
            p.train.observe(event.tokens, event.seconds)
        elif isinstance(event, Trained) and event.backward_tokens and event.backward_seconds > 0:
            p.train.observe(event.backward_tokens / len(event.devices), event.backward_seconds)  # per device
        elif isinstance(event, ShiftDone) and event.seconds > 0:
            p.costs.observe(previous_role, event.role, event.seconds)

    def targets(self, demand: Demand) -> dict[int, Role]:
        view = demand.view
        assert isinstance(view, PlanView), "shiftable mode needs the controller's plan view"
        situation: tuple = (demand.gen_pending > 0, demand.train_ready, demand.training)
        few = self.devices <= EXACT_UP_TO
        if few:  # a few devices: any device that shifts or runs dry is news
            situation += (demand.judge_pending > 0, view.roles, view.pinned, tuple(n == 0 for n in demand.loads))
        if self._last is not None:
            last, _, due, targets = self._last
            if situation == last and view.now < due:  # nothing changed that a plan reacts to
                return targets
        decision = self.planner.plan(
            view.now,
            dict(enumerate(view.roles)),
            dict(enumerate(demand.loads)),
            set(view.pinned),
            view.workload,
            self.profiles,
            self.max_batch,
            self.judge_kv,
        )
        self._train = tuple(d for d, r in sorted(decision.targets.items()) if r is Role.TRAIN)
        # the next plan is due after a small share of the step's estimated rest: often where steps are
        # short, seconds apart where they take minutes
        rest = decision.after.total if decision.after is not None else 0.0
        share = REPLAN_SHARE if few else REPLAN_SHARE_CLUSTER
        # a share of the whole step, not of what is left of it: plans would come ever faster at its end
        self._horizon = max(self._horizon * 0.98, rest) if rest < float("inf") else self._horizon
        due = min(view.now + (share * self._horizon if rest < float("inf") else 0.0), decision.wake)
        self._last = (situation, view.now, due, decision.targets)
        return decision.targets

    def train_devices(self) -> tuple[int, ...]:
        return self._train
