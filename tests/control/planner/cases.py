"""Profiles, workloads and helpers the planner's tests share: a generation profile of known rates, and
workloads of the step's typical moments (a rollout tail, a judge burst, all rewards in, the step's start)."""

from __future__ import annotations

from pivotrl.control.messages import Role
from pivotrl.control.planner import LengthModel, Profiles, RoleProfile, ShiftCosts, TrainProfile, Workload

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN

MAX_BATCH = 32


PER_SEQ = 0.03 / 31  # a decode step takes 0.05 s alone and 0.08 s with 32 sequences


def generation(prefill_rate: float = 1e12) -> RoleProfile:
    """20 tok/s for a sequence alone, 400 tok/s for a device at the batch cap (32); prompts read in
    no time unless ``prefill_rate`` says otherwise."""
    return RoleProfile(step_base=0.05 - PER_SEQ, step_per_seq=PER_SEQ, prefill_rate=prefill_rate)


def profiles(shift: float = 0.05, prior_mean: float = 1000.0, prior_max: float = 2048.0) -> Profiles:
    """Rollout and judge: ``generation()``; train: 1000 tok/s.
    Lengths: the prior only (memoryless, mean ``prior_mean``)."""
    return Profiles(
        rollout=generation(),
        judge=generation(),
        train=TrainProfile(device_rate=1000),
        lengths=LengthModel(prior_mean=prior_mean, prior_max=prior_max),
        costs=ShiftCosts(prior=shift),
    )


def alloc(r: int, g: int, t: int) -> dict[Role, int]:
    return {R: r, G: g, T: t}


def roles(spec: str) -> dict[int, Role | None]:
    """``"rrgt"`` -> {0: rollout, 1: rollout, 2: genrm, 3: train}; ``-`` is no role yet."""
    table = {"r": R, "g": G, "t": T, "-": None}
    return {i: table[c] for i, c in enumerate(spec)}


TAIL = Workload(rollout_remaining=[600, 700], judge_queued=600, judge_future=2, judge_tokens_mean=100)


JUDGE_BURST = Workload(judge_queued=400, judge_tokens_mean=100, train_groups_left=8, train_tokens_per_group=500)


REWARDS_IN = Workload(train_groups_left=16, train_tokens_per_group=2000, step_seconds=1.0)


EARLY = Workload(
    rollout_remaining=[0] * 64,
    judge_future=64,
    judge_tokens_mean=50,
    train_groups_left=8,
    train_tokens_per_group=0.0,  # (every response still to generate: the length model says how long)
    step_seconds=0.5,
)


def judgments(tail: bool) -> LengthModel:
    """1000 judgments of mean 129 tokens: all alike, or (``tail``) 1 in 100 of 3000 tokens and the rest of 100."""
    lm = LengthModel(min_samples=4, window=1000)
    for i in range(1000):
        lm.observe((3000 if i % 100 == 0 else 100) if tail else 129)
    return lm
