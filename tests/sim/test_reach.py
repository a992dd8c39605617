"""The reach benchmark: the floor's rollout replayed on the floor's terms lands on the floor; a judge that pays
for its batch in latency or price cannot beat that; a lockstep trainer starts nothing before the last judgment."""

from __future__ import annotations

import pytest

from pivotrl.sim.groups import GROUPS, job_overrides
from pivotrl.sim.reach import reach, replay, step_of
from pivotrl.sim.run import build

SMALL = ["rollout.prompts_per_step=64"]  # 16 GPUs in instances of 4, 1,024 responses


def job(name: str, *extra: str):
    return GROUPS[name].job([*job_overrides(GROUPS[name], 16, 4), "mode=colocated", *SMALL, *extra])


@pytest.mark.parametrize("name", ["dense-7b", "reasoning-judge"])
def test_the_floors_own_terms_replay_to_the_floor_and_a_batched_judge_does_not_beat_them(name):
    out = reach(job(name), targets=(8, 32, 256))
    floor, check = out["floor_seconds"], out["floors_judge"]["seconds"]
    # the floor's rollout, a judge at full-batch price and batch-1 latency, fluid training: about the floor
    # (a few time steps over it; under it would mean the floor is no floor of its own terms)
    assert floor - 0.1 <= check <= floor * 1.03, (floor, check)
    for b, r in out["batched"].items():  # a judge's batch costs latency or price: never shorter
        assert r["seconds"] >= check - 0.1, (b, r["seconds"], check)
        assert r["judge_instance_s"] >= out["judge_price_instance_s"] * 0.99, (b, r)  # never under the floor's price
    # a judge's batch is a trade: a batch of 8 pays for its latency in price, and neither end is the best for a
    # judge that reasons (a full batch's latency leaves the groups waiting for its longest judgments)
    assert out["best_target"] > 8
    if name == "reasoning-judge":
        assert out["best_target"] < 256


def test_a_lockstep_trainer_trains_nothing_before_the_last_judgment():
    cfg = job("dense-7b", "train.backend=fsdp")
    spec = build(cfg, warn=False).spec
    step = step_of(cfg, spec)
    assert step.lockstep
    r = replay(step, spec, 32)
    backward = sum(step.group_work) / step.devices  # every instance training, from the last judgment on
    assert r["seconds"] >= r["judging_ends_s"] + backward + step.optimizer_s - 0.1
    assert r["trained_by_last_judgment"] == 0.0
    # the floor of a trainer that backpropagates at the step holds the replay of the floor's own terms too
    check = replay(step, spec, None)
    assert check["seconds"] >= step.floor.lockstep_floor_s - 0.1 > step.floor.joint_floor_s
    # the what-if of a cohort training in lockstep before the last judgment: some backward goes before it, and
    # the step pays the group meeting again after it
    early = replay(step, spec, 32, cohort=2, regroup_s=2.0)
    assert early["trained_by_last_judgment"] > 0.0
    assert early["seconds"] >= early["judging_ends_s"] + 2.0 + step.optimizer_s
    zero_cfg = job("dense-7b")  # (ZeRO-1 fits here: each group backpropagated once judged)
    zero_spec = build(zero_cfg, warn=False).spec
    zero = replay(step_of(zero_cfg, zero_spec), zero_spec, 32)
    assert not zero_spec.lockstep_train
    assert zero["seconds"] < r["seconds"]


def test_the_draws_follow_the_seed_and_every_response_is_somewhere():
    cfg = job("dense-7b")
    spec = build(cfg, warn=False).spec
    a, b, c = step_of(cfg, spec, 0), step_of(cfg, spec, 0), step_of(cfg, spec, 1)
    assert a.groups == b.groups and a.groups != c.groups
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert len(a.ends) == n and sorted(a.groups) == sorted(i // cfg.rollout.group_size for i in range(n))
    assert list(a.ends) == sorted(a.ends)  # responses in length order end in that order
    assert sum(a.group_work) == pytest.approx(a.floor.gpu_seconds["train"] / spec.tp)
