"""Instances: how the Ray driver maps the control plane's devices (instances) to the job's devices."""

from __future__ import annotations

import pytest

from pivotrl.control.messages import Accumulated, Role, ShiftDone, TrainShard
from pivotrl.runtime.instances import Instances, Member, combine_accumulated, combine_shifts, split_shard


def test_an_instance_is_consecutive_devices_and_a_step_ranks_them_instance_by_instance():
    inst = Instances.uniform(2, 3)
    assert (inst.devices, inst.count) == (6, 3)
    assert inst.members(1) == (2, 3) and inst.first(2) == 4
    assert [inst.of(d) for d in range(6)] == [0, 0, 1, 1, 2, 2]
    assert inst.member(3) == Member(1, 1, (2, 3))
    assert inst.ranks((2, 0)) == (4, 5, 0, 1)
    assert Instances.uniform(1, 4).ranks((3, 1)) == (3, 1)  # (instances of one: the devices themselves)
    with pytest.raises(ValueError, match="not groups of 2"):
        Instances(2, ((0, 1), (2,)))


def test_instances_never_span_nodes_wherever_the_devices_were_placed():
    inst = Instances.on_nodes(2, ["a", "b", "a", "b", "b", "b"])  # (a placement that interleaves two nodes)
    assert inst.groups == ((0, 2), (1, 3), (4, 5))
    assert inst.member(2) == Member(0, 1, (0, 2)) and inst.of(5) == 2
    with pytest.raises(ValueError, match="node a holds 3 of the job's devices, not a whole number of instances of 2"):
        Instances.on_nodes(2, ["a", "a", "a", "b"])


def _shard(n: int) -> TrainShard:
    return TrainShard(
        tuple((i,) for i in range(n)), tuple((i, i) for i in range(n)), tuple((0.5 * i,) for i in range(n)),
        tuple(float(i) for i in range(n)),
    )  # fmt: skip


@pytest.mark.parametrize(("n", "parts", "sizes"), [(5, 2, [2, 3]), (4, 4, [1, 1, 1, 1]), (1, 3, [0, 0, 1])])
def test_a_shard_is_cut_into_runs_of_whole_samples_that_add_up_to_it(n, parts, sizes):
    shard = _shard(n)
    cut = split_shard(shard, parts)
    assert [len(p.advantages) for p in cut] == sizes
    for field in ("prompt_ids", "response_ids", "logprobs", "advantages"):
        assert sum((getattr(p, field) for p in cut), ()) == getattr(shard, field)


def test_an_instances_answers_are_one_event_its_work_summed_its_time_the_longest():
    shifts = [ShiftDone(1, Role.ROLLOUT, 3, 2.0, 100), ShiftDone(1, Role.ROLLOUT, 3, 5.0, 40)]
    assert combine_shifts(shifts) == ShiftDone(1, Role.ROLLOUT, 3, 5.0, 140)
    acc = [Accumulated(0, 3, 30, 1.5), Accumulated(0, 2, 25, 1.0)]
    assert combine_accumulated(acc) == Accumulated(0, 5, 55, 1.5)
