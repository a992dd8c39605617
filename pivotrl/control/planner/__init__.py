"""The planner of shiftable mode: when, and how many, devices move between roles.

It turns live demand (a ``Workload``) and measured ``Profiles`` (both in
``pivotrl.control.profiles``) into a decision, in three pure steps:

1. ``estimate``: a fluid model of the rest of the step gives, for one allocation
   (devices per role), the time until the step completes and when each phase ends.
2. ``Planner.plan``: every allocation is estimated, the devices that would move
   joining their new role only after their shift, and the requests they hold
   costing their re-prefill where they migrate. The best one replaces the current
   one only when it wins by more than a margin (hysteresis), and a device that
   just moved may not go back for a while (cooldown): demand that oscillates
   faster than shifts pay off must not make devices flap.
3. The devices that move are the cheapest to take: idle first, then the least
   loaded (fewest sequences to migrate), never pinned ones.

Every decision that moves something is logged with a one-line reason carrying
the numbers it was made from, so a timeline can be read next to the log.

The parts, each usable alone:

- ``alloc``: allocations, moves, late arrivals and their short forms;
- ``fluid``: the fluid model of work done by devices joining over time;
- ``work``: the work summary, a workload reduced to one record per phase;
- ``memo``: what every allocation of one plan asks alike, computed once;
- ``phases``: the per-phase estimate of one allocation (``PhaseModel``);
- ``search``: the allocations a plan weighs, the devices each moves, the best;
- ``lending``: train devices generating for the rollout until needed in train;
- ``planner``: the ``Planner`` that decides, with hysteresis and cooldown.
"""

from pivotrl.control.planner.alloc import Alloc, Batch, Move, fmt_alloc
from pivotrl.control.planner.phases import Estimate, PhaseModel, estimate
from pivotrl.control.planner.planner import Decision, Planner
from pivotrl.control.planner.search import initial_split
from pivotrl.control.planner.work import Work, summarize
from pivotrl.control.profiles import LengthModel, Profiles, RoleProfile, ShiftCosts, TrainProfile, Workload

__all__ = [
    "Alloc",
    "Batch",
    "Decision",
    "Estimate",
    "LengthModel",
    "Move",
    "PhaseModel",
    "Planner",
    "Profiles",
    "RoleProfile",
    "ShiftCosts",
    "TrainProfile",
    "Work",
    "Workload",
    "estimate",
    "fmt_alloc",
    "initial_split",
    "summarize",
]
