"""Allocation policies: which role each device should hold, given demand.

A policy is pure placement math: it reads a ``Demand`` snapshot and answers
with a target role per device and the devices that train. The controller
turns differences between a device's role and its target into ``Shift``
commands when the device is idle. Registered by name; an unknown name fails
loudly with the list of known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pivotrl.control.messages import Role


@dataclass(slots=True, frozen=True)
class Demand:
    """What is left to do in the current step."""

    gen_pending: int  # rollout (and evaluation) requests queued or in flight
    judge_pending: int  # judge requests queued or in flight, plus responses still to come
    train_ready: bool  # every reward of the step is in and the update has not started
    training: bool  # the update is running
    loads: tuple[int, ...] = ()  # requests in flight per device
    view: Any = None  # the controller's PlanView, for policies that plan (shiftable)


class AllocationPolicy(Protocol):
    name: str
    devices: int
    preempt: bool  # may a device leave a role with requests in flight (they migrate)?
    wants_view: bool  # does targets() need demand.view (the controller builds it only then)?

    def observe(self, event: Any, previous_role: Role | None) -> None: ...

    def targets(self, demand: Demand) -> dict[int, Role]: ...

    def train_devices(self) -> tuple[int, ...]: ...


class StaticPolicy:
    """Policies that ignore live measurements."""

    wants_view = False

    def observe(self, event: object, previous_role: Role | None) -> None:
        pass


class Colocated(StaticPolicy):
    """Every device takes every role, phase after phase: all generate, then all
    judge, then all train."""

    name = "colocated"
    preempt = False

    def __init__(self, devices: int) -> None:
        if devices < 1:
            raise ValueError(f"colocated needs at least 1 device, got {devices}")
        self.devices = devices

    def targets(self, demand: Demand) -> dict[int, Role]:
        if demand.gen_pending:
            role = Role.ROLLOUT
        elif demand.judge_pending:
            role = Role.JUDGE
        elif demand.train_ready or demand.training:
            role = Role.TRAIN
        else:
            role = Role.ROLLOUT
        return dict.fromkeys(range(self.devices), role)

    def train_devices(self) -> tuple[int, ...]:
        return tuple(range(self.devices))


def default_split(devices: int, train: int = 1) -> dict[Role, int]:
    """A split for disaggregated mode when none is given: ``train`` trainers (the fewest the
    optimizer step may run on), a judge per three devices beyond them, the rest on rollout."""
    if devices < train + 2:
        raise ValueError(
            f"disaggregated mode needs at least {train + 2} devices ({train} to train, one each to generate and "
            f"judge), got {devices}"
        )
    judge = max(1, round((devices - train) / 3))
    return {Role.ROLLOUT: devices - train - judge, Role.JUDGE: judge, Role.TRAIN: train}


class Disaggregated(StaticPolicy):
    """A static split: each device keeps one role for the whole job."""

    name = "disaggregated"
    preempt = False

    def __init__(self, devices: int, split: dict[Role, int] | None = None, min_train: int = 1) -> None:
        split = split or default_split(devices, min_train)
        missing = [r.value for r in Role if split.get(r, 0) < 1]
        if missing:
            raise ValueError(f"split: disaggregated mode needs at least one device for {', '.join(missing)}")
        if sum(split.values()) != devices:
            layout = ",".join(f"{r.value}:{n}" for r, n in split.items())
            raise ValueError(f"split: {layout} uses {sum(split.values())} devices, but devices={devices}")
        if split[Role.TRAIN] < min_train:
            raise ValueError(
                f"split: train:{split[Role.TRAIN]} is fewer than the {min_train} devices the optimizer step needs "
                "(train.min_devices)"
            )
        self.devices = devices
        self.split = split
        self.roles: dict[int, Role] = {}
        for role in Role:  # rollout devices first, then judge, then train
            for _ in range(split[role]):
                self.roles[len(self.roles)] = role

    def targets(self, demand: Demand) -> dict[int, Role]:
        return dict(self.roles)

    def train_devices(self) -> tuple[int, ...]:
        return tuple(d for d, r in self.roles.items() if r is Role.TRAIN)


def make_policy(
    mode: str,
    devices: int,
    split: dict[str, int] | None = None,
    max_batch: int = 64,
    rollout_tokens: int = 64,
    judge_tokens: int = 64,
    step_samples: int = 0,
    min_train: int = 1,
) -> AllocationPolicy:
    """The allocation policy registered under ``mode``; ``min_train``: the fewest devices the optimizer step
    may run on (``train.min_devices``)."""
    if mode in ("colocated", "shiftable") and devices < min_train:
        raise ValueError(f"train.min_devices: the optimizer step needs {min_train} devices, but the job has {devices}")
    if mode == "colocated":
        if split:
            raise ValueError("split: only used with mode=disaggregated")
        return Colocated(devices)
    if mode == "disaggregated":
        return Disaggregated(devices, {Role(k): v for k, v in split.items()} if split else None, min_train)
    if mode == "shiftable":
        if split:
            raise ValueError("split: only used with mode=disaggregated")
        from pivotrl.control.shiftable import Shiftable

        return Shiftable(devices, max_batch, rollout_tokens, judge_tokens, step_samples)
    known = ", ".join(("colocated", "disaggregated", "shiftable"))
    raise ValueError(f"mode: {mode!r} is not available (known: {known})")
