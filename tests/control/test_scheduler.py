"""Request queues and least-loaded dispatch."""

from __future__ import annotations

import pytest

from pivotrl.control.messages import Generate, GenParams, GenRequest, Judge, JudgeRequest
from pivotrl.control.scheduler import JudgeQueue, Scheduler

P = GenParams(max_new_tokens=4)


def gen(*uids: int) -> list[GenRequest]:
    return [GenRequest(u, f"p{u}", seed=u, params=P) for u in uids]


def judge(*uids: int) -> list[JudgeRequest]:
    return [JudgeRequest(u, "q", "r", "a", seed=u, params=P) for u in uids]


def placed(cmds: list[Generate] | list[Judge]) -> dict[int, list[int]]:
    return {c.device: [r.uid for r in c.requests] for c in cmds}


DISPATCH = [
    # per_device, already in flight {device: uids}, queued uids, devices offered, expected placement
    pytest.param(4, {}, [0, 1, 2, 3], [0, 1], {0: [0, 2], 1: [1, 3]}, id="round-robin-when-equal"),
    pytest.param(4, {}, [0, 1, 2], [2, 0, 1], {0: [0], 1: [1], 2: [2]}, id="ties-lowest-device-id"),
    pytest.param(4, {0: [90, 91]}, [0, 1, 2], [0, 1], {1: [0, 1], 0: [2]}, id="least-loaded-first"),
    pytest.param(4, {0: [90, 91, 92]}, [0, 1, 2, 3], [0, 1], {1: [0, 1, 2], 0: [3]}, id="fill-up-to-balance"),
    pytest.param(2, {}, [0, 1, 2, 3, 4, 5], [0, 1], {0: [0, 2], 1: [1, 3]}, id="cap-leaves-rest-queued"),
    pytest.param(2, {0: [90, 91]}, [0, 1, 2], [0, 1], {1: [0, 1]}, id="full-device-gets-nothing"),
    pytest.param(2, {0: [90, 91], 1: [92, 93]}, [0], [0, 1], {}, id="all-full"),
    pytest.param(4, {}, [0, 1], [], {}, id="no-device"),
    pytest.param(4, {}, [], [0, 1], {}, id="empty-queue"),
    pytest.param(1, {5: [90]}, [0, 1], [3, 5], {3: [0]}, id="only-offered-devices"),
]


def scheduler_with(per_device: int, inflight: dict[int, list[int]], judging: bool = False) -> Scheduler:
    s = Scheduler(per_device)
    for device, uids in inflight.items():
        if judging:
            s.submit_judge(judge(*uids))
            assert placed(s.dispatch_judge([device])) == {device: uids}
        else:
            s.submit_gen(gen(*uids))
            assert placed(s.dispatch_gen([device], 0)) == {device: uids}
    return s


@pytest.mark.parametrize(("per_device", "inflight", "queued", "devices", "expected"), DISPATCH)
def test_dispatch_gen(per_device, inflight, queued, devices, expected):
    s = scheduler_with(per_device, inflight)
    s.submit_gen(gen(*queued))
    cmds = s.dispatch_gen(devices, version=3)
    assert placed(cmds) == expected
    assert all(c.version == 3 for c in cmds)
    sent = {u for uids in expected.values() for u in uids}
    assert [r.uid for r in s.gen_queue] == [u for u in queued if u not in sent]  # the rest stays queued, in order
    for d in devices:
        assert s.load(d) == len(inflight.get(d, [])) + len(expected.get(d, [])) <= per_device


@pytest.mark.parametrize(("per_device", "inflight", "queued", "devices", "expected"), DISPATCH)
def test_dispatch_judge(per_device, inflight, queued, devices, expected):
    s = scheduler_with(per_device, inflight, judging=True)  # every judgment weighs the same by default
    s.submit_judge(judge(*queued))
    assert placed(s.dispatch_judge(devices)) == expected
    sent = {u for uids in expected.values() for u in uids}
    assert [r.uid for r in s.judge_queue] == [u for u in queued if u not in sent]


def test_finished_frees_capacity_for_the_queue():
    s = Scheduler(per_device=2)
    s.submit_gen(gen(0, 1, 2, 3, 4))
    assert placed(s.dispatch_gen([0], 0)) == {0: [0, 1]}
    assert s.dispatch_gen([0], 0) == []  # full
    s.finished(0, 1)
    assert s.load(0) == 1
    assert placed(s.dispatch_gen([0], 0)) == {0: [2]}
    s.finished(0, 0)
    s.finished(0, 2)
    assert placed(s.dispatch_gen([0], 0)) == {0: [3, 4]}
    assert not s.gen_queue


def test_submit_front_puts_requests_first_in_their_order():
    s = Scheduler(per_device=10)
    s.submit_gen(gen(0, 1))
    s.submit_gen(gen(100, 101, 102), front=True)
    s.submit_gen(gen(2))
    assert [r.uid for r in s.gen_queue] == [100, 101, 102, 0, 1, 2]
    assert placed(s.dispatch_gen([0], 0)) == {0: [100, 101, 102, 0, 1, 2]}


def test_per_device_must_be_positive():
    with pytest.raises(ValueError, match="per_device must be >= 1, got 0"):
        Scheduler(0)


@pytest.mark.parametrize("joining, expected", [(0, [128, 128]), (2, [64, 64]), (6, [32, 32])])
def test_devices_still_shifting_in_keep_a_share(joining, expected):
    s = Scheduler(per_device=128)
    s.submit_gen(gen(*range(256)))
    first = placed(s.dispatch_gen([0, 1], version=0, joining=joining))
    assert [len(first.get(d, [])) for d in (0, 1)] == expected
    s.dispatch_gen([0, 1, 2, 3], version=0)  # the others arrive: the work ends up even
    assert [s.load(d) for d in range(4)] == ([128, 128, 0, 0] if joining == 0 else [64] * 4)


def test_judgments_have_their_own_cap():
    s = Scheduler(per_device=8, judge_per_device=2)
    s.submit_gen(gen(*range(20)))
    s.submit_judge(judge(*range(100, 120)))
    assert [len(c.requests) for c in s.dispatch_gen([0, 1], version=0)] == [8, 8]
    assert [len(c.requests) for c in s.dispatch_judge([2, 3])] == [2, 2]
    assert len(s.judge_queue) == 16  # the rest waits here for whichever judge frees up (or joins) first
    assert s.loads(4) == (8, 8, 2, 2)
    with pytest.raises(ValueError, match="judge_per_device must be >= 1"):
        Scheduler(4, judge_per_device=-1)


REBALANCE = [
    # in flight {device: uids}, devices offered, cost per uid, expected uids taken back per device
    pytest.param({0: [1, 2, 3], 1: [4]}, [0, 1], {}, {}, id="within-twice-plus-one"),
    pytest.param({0: [1, 2, 3, 4], 1: [5]}, [0, 1], {}, {0: [1]}, id="down-to-an-even-share"),
    pytest.param({0: [1, 2], 1: []}, [0, 1], {}, {0: [1]}, id="an-idle-device-takes-one-of-two"),
    pytest.param({0: [1, 2, 3, 4], 1: []}, [0, 1], {1: 9, 2: 0, 3: 5, 4: 0}, {0: [2, 4]}, id="cheapest-first"),
    pytest.param(
        {0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10, 11], 2: [], 3: [12]},
        [0, 1, 2, 3],
        {},
        {0: [1, 2, 3], 1: [7, 8]},
        id="every-device-above-the-share",
    ),
    pytest.param({0: [1, 2, 3, 4], 1: []}, [0], {}, {}, id="one-device"),
    pytest.param({0: [1, 2, 3, 4], 1: []}, [0, 5], {}, {0: [1, 2]}, id="only-offered-devices"),
    pytest.param({}, [0, 1], {}, {}, id="nothing-in-flight"),
]


@pytest.mark.parametrize(("inflight", "devices", "cost", "expected"), REBALANCE)
def test_rebalance_takes_back_the_excess_of_the_most_loaded(inflight, devices, cost, expected):
    s = scheduler_with(8, {d: uids for d, uids in inflight.items() if uids})
    assert s.rebalance(devices, lambda u: cost.get(u, 0)) == expected
    assert s.load(0) == len(inflight.get(0, []))  # it only names requests: the abort takes them back


def test_rebalanced_requests_go_back_to_the_least_loaded():
    s = scheduler_with(8, {0: [1, 2, 3, 4, 5, 6], 1: [7]})
    taken = s.rebalance([0, 1], lambda u: 0)
    assert taken == {0: [1, 2]}
    for u in taken[0]:
        s.finished(0, u)  # what the abort's answer does, then the requests go to the front of the queue
    s.submit_gen(gen(*taken[0]), front=True)
    assert placed(s.dispatch_gen([0, 1], 0)) == {1: [1, 2]}
    assert (s.load(0), s.load(1)) == (4, 3) and s.rebalance([0, 1], lambda u: 0) == {}


def queued_uids(s: Scheduler) -> list[int]:
    return [r.uid for r in s.judge_queue]


def test_judgments_of_a_whole_group_go_first_in_their_order():
    s = Scheduler(per_device=2)
    s.submit_judge(judge(0, 1, 2, 3, 4, 5))
    s.judge_first({4, 2, 9})  # 9 is not queued (judged already, or running)
    assert queued_uids(s) == [2, 4, 0, 1, 3, 5]
    s.judge_first({5, 1})  # a group whole later goes after the first one, not before it
    assert queued_uids(s) == [2, 4, 1, 5, 0, 3]
    s.judge_first({7})  # none of it queued: nothing moves
    assert queued_uids(s) == [2, 4, 1, 5, 0, 3]


def test_requests_sent_first_stay_first_as_the_queue_drains():
    s = Scheduler(per_device=2)
    s.submit_judge(judge(0, 1, 2, 3, 4, 5))
    s.judge_first({3, 4})
    assert placed(s.dispatch_judge([0])) == {0: [3, 4]}  # the whole group's two went out
    s.judge_first({1})  # the first ones are gone: 1 goes to the very front
    assert queued_uids(s) == [1, 0, 2, 5]
    s.submit_judge(judge(8), front=True)  # a migrated judgment stays ahead of the group sent first
    s.judge_first({5})
    assert queued_uids(s) == [8, 1, 5, 0, 2]
    assert placed(s.dispatch_judge([1])) == {1: [8, 1]}
    s.judge_first({2})
    assert queued_uids(s) == [5, 2, 0]


def test_judgments_go_to_the_device_with_the_least_work_in_flight():
    weight = {0: 10.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 8.0, 5: 1.0, 6: 1.0, 7: 5.0}
    s = Scheduler(per_device=3, judge_weight=weight.__getitem__)
    s.submit_judge(judge(0, 1, 2, 3, 4, 5, 6, 7))
    # room for 6: the first 6 in queue order go, placed heaviest first on the least loaded device
    # (0 -> device 0, 4 -> 1, then the light ones on 1 while it is lighter), 6 and 7 wait
    assert placed(s.dispatch_judge([0, 1])) == {0: [0, 3, 5], 1: [4, 1, 2]}
    assert [r.uid for r in s.judge_queue] == [6, 7] and s._work == {0: 12.0, 1: 10.0}
    s.finished(0, 0)  # device 0: 2 left in flight, device 1: 9
    s.finished(1, 1)
    # 17 of work for 2 devices: device 1 (9) is past its share, device 0 (2) takes 6 and is full (3 in flight)
    assert placed(s.dispatch_judge([0, 1])) == {0: [6]}
    assert [r.uid for r in s.judge_queue] == [7] and s._work == {0: 3.0, 1: 9.0}
    s.finished(1, 4)  # device 1 down to 1 of work: 7 goes there
    assert placed(s.dispatch_judge([0, 1])) == {1: [7]}
    assert s._work == {0: 3.0, 1: 6.0} and not s.judge_queue and s._queued_work == 0.0


def test_judgments_stop_at_an_even_share_of_the_work_so_late_devices_get_some():
    # the step's end: devices 0 and 1 are free, 2 and 3 busy with 10 each; eight long judgments of 5 arrive
    s = Scheduler(per_device=10, judge_weight=lambda uid: 5.0 if uid >= 100 else 1.0)
    s.submit_judge(judge(*range(20)))
    placed(s.dispatch_judge([2, 3]))
    assert s._work == {2: 10.0, 3: 10.0}
    s.submit_judge(judge(*range(100, 108)))  # 40 queued, 20 in flight: 15 a device
    assert placed(s.dispatch_judge([0, 1, 2, 3])) == {0: [100, 102, 104], 1: [101, 103, 105]}
    assert [r.uid for r in s.judge_queue] == [106, 107] and s._queued_work == 10.0  # kept for 2 and 3
    for uid in range(10, 20):
        s.finished(3, uid)
    assert placed(s.dispatch_judge([0, 1, 2, 3])) == {3: [106, 107]}


def test_a_judgment_goes_where_its_group_was_sent_unless_that_device_holds_more_than_it_above_the_least():
    def of(group: int, *uids: int) -> list[JudgeRequest]:
        return [JudgeRequest(u, "q", "r", "a", seed=u, params=P, group=group) for u in uids]

    s = Scheduler(per_device=8)
    s.submit_judge(of(5, 0) + of(6, 1))
    assert placed(s.dispatch_judge([0, 1])) == {0: [0], 1: [1]}
    # device 1 is the least loaded once 1 is done, but 2 goes where its group's first went: device 0 reads the
    # group's beginning from its cache; 3, of no group, goes to the least loaded
    s.finished(1, 1)
    s.submit_judge(of(5, 2) + judge(3))
    assert placed(s.dispatch_judge([0, 1])) == {0: [2], 1: [3]}
    # the group's device takes a judgment only while it holds at most that judgment's work more than the least
    # loaded: device 0 (2) takes 4 beside device 1 (1), not 5 (3 against 1); 5 goes to device 1, which becomes
    # the group's device and takes 6 and 7 (3 beside 3)
    s.submit_judge(of(5, 4, 5, 6, 7))
    assert placed(s.dispatch_judge([0, 1])) == {0: [4], 1: [5, 6, 7]}
    assert s._home == {5: 1, 6: 1}


def test_a_paged_judge_cache_bounds_what_a_device_is_handed():
    """With ``judge_kv`` a device takes judgments while what they read fits its cache (the last one
    may cross it): the long ones left wait in the queue for the devices that free up next."""
    s = Scheduler(per_device=100, judge_weight=lambda uid: 1000.0 if uid >= 100 else 100.0, judge_kv=2000)
    s.submit_judge(judge(*range(100, 110)))  # ten long judgments, two devices: a share is 5,000 tokens
    assert placed(s.dispatch_judge([0, 1])) == {0: [100, 102], 1: [101, 103]}
    assert [r.uid for r in s.judge_queue] == [104, 105, 106, 107, 108, 109]
    s.finished(0, 100)
    assert placed(s.dispatch_judge([0, 1])) == {0: [104]}  # room for one more
    s.submit_judge(judge(1, 2))  # short ones queue behind the long ones still waiting
    assert placed(s.dispatch_judge([0, 1])) == {}
    # without a cache limit the same devices take every judgment at once
    unbounded = Scheduler(per_device=100, judge_weight=lambda uid: 900.0)
    unbounded.submit_judge(judge(*range(100, 110)))
    assert sum(len(u) for u in placed(unbounded.dispatch_judge([0, 1])).values()) == 10
    with pytest.raises(ValueError, match="judge_kv"):
        Scheduler(per_device=4, judge_kv=0)


def test_the_judge_queue_sends_groups_first_at_the_cost_of_the_group():
    q = JudgeQueue()
    q.extend(judge(0, 1, 2, 3, 4, 5))
    q.send_first([5, 1, 9])  # in arrival order; 9 is not waiting
    q.push_front(judge(7))  # a migrated judgment goes before everything
    assert [r.uid for r in q] == [7, 1, 5, 0, 2, 3, 4] and len(q) == 7
    assert [q.popleft().uid for _ in range(4)] == [7, 1, 5, 0]
    q.send_first([4, 2, 3])  # every waiting request sent first: nothing is left behind in the rest
    assert [r.uid for r in q] == [2, 3, 4] and not q._rest
    assert [q.popleft().uid for _ in range(3)] == [2, 3, 4] and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()
