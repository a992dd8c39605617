"""The controller driven over fake in-memory devices (pure Python: no torch, no Ray).

The fake answers every command the way a device would, deterministically:
rollout answers a training prompt correctly for even uids and wrongly for odd
ones; evaluation of policy version v answers the first v held-out problems
correctly (so the accuracy reported for a step tells which weights served it);
the judge says "VERDICT: yes" exactly when the response is correct; an update
of version v publishes v + 1. Shifts and updates finish at once; generation and
judging stream ``per_tick`` results per device per tick.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import pytest

from pivotrl.control.controller import Controller
from pivotrl.control.evaluation import EVAL_STRIDE, EVAL_UID
from pivotrl.control.messages import (
    Abort,
    Aborted,
    Accumulate,
    Accumulated,
    Command,
    DeviceJoined,
    DeviceLost,
    Event,
    Generate,
    Generated,
    GenParams,
    GenRequest,
    GenResult,
    Judge,
    Judged,
    JudgeRequest,
    JudgeResult,
    Progress,
    Role,
    Shift,
    ShiftDone,
    Step,
    StepFailed,
    Trained,
)
from pivotrl.control.modes import Colocated, Disaggregated
from pivotrl.control.shiftable import Shiftable
from pivotrl.control.spec import STEP_UID, DeviceLostError, LoopSpec
from pivotrl.control.training import UPDATE_ATTEMPTS, train_needed
from pivotrl.reward.genrm import GenRM
from pivotrl.sample import Problem, Status
from pivotrl.task.rules import exact_match

R, G, T = Role.ROLLOUT, Role.JUDGE, Role.TRAIN
TEMPLATE = "Q: {question}\nA:"
TRAIN_SET = [Problem(f"{a}+{a}", str(2 * a)) for a in range(1, 7)]
HELDOUT = [Problem(f"{a}*3", str(3 * a)) for a in range(1, 5)]
REFERENCE = {TEMPLATE.format(question=p.question): p.reference for p in TRAIN_SET + HELDOUT}
STEPS, PROMPTS, GROUP = 3, 4, 2
SAMPLES = PROMPTS * GROUP


def spec(**overrides) -> LoopSpec:
    base = LoopSpec(
        seed=0,
        steps=STEPS,
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        prompt_template=TEMPLATE,
        rollout=GenParams(8, 1.0),
        judge=GenParams(8, 0.0),
        eval_params=GenParams(8, 0.0),
        eval_every=1,
        scale_by_std=True,
        per_device=4,
        check=exact_match,
    )
    return replace(base, **overrides)


def genrm() -> GenRM:
    return GenRM("{response}", "VERDICT: *(yes|no)", {"yes": 1.0, "no": 0.0}, 0.0)


def expected_accuracy(version: int) -> float:
    return min(version, len(HELDOUT)) / len(HELDOUT)


def response(uid: int, reference: str, version: int) -> str:
    if uid >= EVAL_UID:
        right = (uid - EVAL_UID) % EVAL_STRIDE < version  # held-out item i is right once version > i
    else:
        right = uid % 2 == 0
    return f"the answer is {reference if right else int(reference) + 1}"


class FakeCluster:
    """Devices in memory. Checks on every command that the controller asks only what a device can do."""

    def __init__(
        self, ctl: Controller, per_tick: int = 1, wrong_version: bool = False, eval_last: bool = False
    ) -> None:
        self.ctl, self.per_tick, self.wrong_version, self.eval_last = ctl, per_tick, wrong_version, eval_last
        n = ctl.policy.devices
        self.role: list[Role | None] = [None] * n
        self.version = [-1] * n
        self.work: dict[int, deque[GenResult | JudgeResult]] = {d: deque() for d in range(n)}
        self.training: set[int] = set()
        self.ready: list[Event] = []
        self.log: list[Command | Event] = []  # every command and event, in order
        self.roles_after_batch: list[tuple[Role | None, ...]] = []
        self.trains: list[
            tuple[Step, dict[int, float], list[Accumulate]]
        ] = []  # each update, its rewards, its backwards
        self.accumulates: list[Accumulate] = []  # backwards of the step in progress
        self.aborts = 0
        self.requests: dict[int, GenRequest | JudgeRequest] = {}  # uid -> request in flight, to hand back on Abort

    def submit(self, cmd: Command) -> None:
        self.log.append(cmd)
        if isinstance(cmd, Shift):
            d = cmd.device
            assert not self.work[d] and d not in self.training, f"shift of busy device {d}"
            self.role[d], self.version[d] = cmd.role, cmd.version
            self.ready.append(ShiftDone(d, cmd.role, cmd.version, 0.5, 1000))
        elif isinstance(cmd, Generate):
            d = cmd.device
            assert (self.role[d], self.version[d]) == (R, cmd.version), f"device {d}: {self.role[d]} v{self.version[d]}"
            served = cmd.version + 1 if self.wrong_version else cmd.version
            for r in cmd.requests:
                assert all(x.uid != r.uid for x in self.work[d]), f"device {d} already runs sequence {r.uid}"
                self.requests[r.uid] = r
                out = [r.uid % EVAL_UID] + [50] * (r.uid % 3)
                text = response(r.uid, REFERENCE[r.prompt], cmd.version)
                self.work[d].append(GenResult(r.uid, [7, 8], out, [-0.5] * len(out), text, "stop", served))
        elif isinstance(cmd, Judge):
            d = cmd.device
            assert self.role[d] is G, f"judge requests to device {d} holding {self.role[d]}"
            for r in cmd.requests:
                group = r.uid // STEP_UID * PROMPTS + r.uid % STEP_UID // GROUP  # (its prompt's, apart by step)
                assert r.group == group, f"judgment {r.uid} names group {r.group}"
                self.requests[r.uid] = r
                verdict = "yes" if r.response == f"the answer is {r.reference}" else "no"
                self.work[d].append(JudgeResult(r.uid, f"looks {verdict}. VERDICT: {verdict}", False, 5))
        elif isinstance(cmd, Accumulate):
            d = cmd.device
            assert (self.role[d], self.version[d]) == (T, cmd.version), f"backward on device {d}"
            by_uid = self.ctl.book.by_uid  # (the oldest step's: the one trained)
            uids = [resp[0] for resp in cmd.shard.response_ids]
            assert all(by_uid[u].status is Status.JUDGED for u in uids), "a backward before its group's rewards"
            self.accumulates.append(cmd)
            self.ready.append(Accumulated(d, len(uids), sum(map(len, cmd.shard.response_ids)), 0.1))
        elif isinstance(cmd, Step):
            for d in cmd.devices:
                assert (self.role[d], self.version[d]) == (T, cmd.version), f"step on device {d}"
                assert not self.work[d]
                self.version[d] = cmd.version + 1
            assert not any(self.work[d] for d in range(len(self.role)) if self.role[d] is G), "judging still runs"
            samples = self.ctl.book.samples
            assert all(s.status is Status.JUDGED for s in samples), "an update before every reward is in"
            self.trains.append((cmd, {s.uid: s.reward for s in samples}, self.accumulates))
            self.accumulates = []
            self.training |= set(cmd.devices)
            self.ready.append(Trained(cmd.devices, cmd.version + 1, {"loss": 0.0}, 1.0))
        elif isinstance(cmd, Abort):  # hand back what has not finished (all, or cmd.uids); it starts over elsewhere
            d, take = cmd.device, set(cmd.uids)
            back = [self.requests.pop(r.uid) for r in self.work[d] if not take or r.uid in take]
            self.work[d] = deque(r for r in self.work[d] if take and r.uid not in take)
            self.aborts += 1
            gen = tuple(r for r in back if isinstance(r, GenRequest))
            self.ready.append(Aborted(d, gen, tuple(r for r in back if isinstance(r, JudgeRequest)), 0.01))
        else:
            raise TypeError(cmd)

    def batch_done(self) -> None:
        self.roles_after_batch.append(tuple(self.role))

    def next_events(self) -> list[Event]:
        out, self.ready = self.ready, []
        if not out:
            # eval_last: evaluation finishes only once no training sample is generating or being judged
            hold = self.eval_last and any(r.uid < EVAL_UID for q in self.work.values() for r in q)
            for d, queue in self.work.items():
                batch = tuple([r for r in queue if not (hold and r.uid >= EVAL_UID)][: self.per_tick])
                for r in batch:
                    queue.remove(r)
                if batch:
                    out.append(Generated(d, batch) if self.role[d] is R else Judged(d, batch))
        assert out, "stall: the controller waits, but no device has work"
        for e in out:
            if isinstance(e, Trained):
                self.training -= set(e.devices)
        self.log += out
        return out


def run(ctl: Controller, batched: bool = False, cluster_type: type[FakeCluster] | None = None, **fake) -> FakeCluster:
    cluster = (cluster_type or FakeCluster)(ctl, **fake)
    commands = ctl.start()
    for _ in range(10_000):
        for c in commands:
            cluster.submit(c)
        cluster.batch_done()
        if ctl.done:
            return cluster
        events = cluster.next_events()
        commands = ctl.handle_all(events) if batched else [c for e in events for c in ctl.handle(e)]
    raise AssertionError("the job did not end")


def controller(policy, **overrides) -> Controller:
    clock = itertools.count()
    return Controller(spec(**overrides), policy, genrm(), TRAIN_SET, HELDOUT, lambda: float(next(clock)))


def phases(log: list[Command | Event]) -> list[str]:
    """The kinds of work commands in order, repeats collapsed."""
    names = {Generate: "rollout", Judge: "judge", Accumulate: "train", Step: "train"}
    kinds = [names[type(x)] for x in log if type(x) in names]
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def per_step(log: list[Command | Event]) -> list[list[Command | Event]]:
    """The log cut after each Step command."""
    cuts = [i + 1 for i, x in enumerate(log) if isinstance(x, Step)]
    return [log[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]


def check_results(ctl: Controller, cluster: FakeCluster) -> None:
    """What every mode must produce with this fake."""
    assert ctl.done and ctl.version == STEPS
    assert ctl.accuracy == {v: expected_accuracy(v) for v in range(STEPS + 1)}
    assert [m["step"] for m in ctl.metrics] == list(range(1, STEPS + 1))
    for m in ctl.metrics:
        assert m["heldout_accuracy"] == expected_accuracy(m["step"])
        assert m["reward_mean"] == 0.5 and m["accuracy"] == 0.5 and m["judge_agreement"] == 1.0
        assert m["parse_failures"] == 0 and m["judge_outcomes"] == {"parsed": SAMPLES}
        assert m["judge_tokens"] == 5 * SAMPLES and m["train_loss"] == 0.0
    assert [cmd.version for cmd, _, _ in cluster.trains] == list(range(STEPS))
    train_devices = ctl.policy.train_devices()
    for cmd, rewards, backwards in cluster.trains:
        assert rewards == {u: 1.0 if u % 2 == 0 else 0.0 for u in range(SAMPLES)}  # the fake verdicts
        assert cmd.devices == train_devices
        assert {b.device for b in backwards} <= set(train_devices)
        uids = sorted(resp[0] for b in backwards for resp in b.shard.response_ids)
        assert uids == list(range(SAMPLES))  # every sample exactly once
        for b in backwards:
            mine = [resp[0] for resp in b.shard.response_ids]
            for u, adv, lp in zip(mine, b.shard.advantages, b.shard.logprobs, strict=True):
                assert adv == pytest.approx(1.0 if u % 2 == 0 else -1.0, abs=1e-4)
                assert len(lp) == 1 + u % 3
        assert cmd.total_tokens == sum(1 + u % 3 for u in range(SAMPLES))


# -- colocated ----------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [1, 3], ids=lambda n: f"{n}dev")
def test_colocated_runs_every_phase_on_every_device(devices):
    ctl = controller(Colocated(devices))
    cluster = run(ctl)
    check_results(ctl, cluster)
    for roles in cluster.roles_after_batch:
        assert len(set(roles)) == 1, f"devices hold different roles at once: {roles}"
    assert phases(cluster.log) == ["rollout", "judge", "train"] * STEPS + ["rollout"]  # last: evaluation of v3
    shifts = [x for x in cluster.log if isinstance(x, Shift)]
    assert len(shifts) == devices * (3 * STEPS + 1)
    for step, part in enumerate(per_step(cluster.log)):
        roles = [x.role for x in part if isinstance(x, Shift)]
        assert roles == [R] * devices + [G] * devices + [T] * devices
        assert {x.version for x in part if isinstance(x, Shift) and x.role is not G} == {step}
    assert all(s.role is R and s.version == STEPS for s in shifts[-devices:])
    assert [m["shifts"] for m in ctl.metrics] == [3 * devices] * STEPS


# -- disaggregated --------------------------------------------------------------------------


def test_disaggregated_keeps_roles_refreshes_rollout_and_streams_judging():
    policy = Disaggregated(4)  # rollout: 0, 1; genrm: 2; train: 3
    ctl = controller(policy)
    cluster = run(ctl)
    check_results(ctl, cluster)
    roles = policy.targets(ctl.demand())
    assert roles == {0: R, 1: R, 2: G, 3: T}
    shifts = [x for x in cluster.log if isinstance(x, Shift)]
    assert all(s.role is roles[s.device] for s in shifts)  # nobody ever changes role
    assert shifts[:4] == [Shift(d, roles[d], 0) for d in range(4)]
    refreshes = [(s.device, s.version) for s in shifts[4:]]
    assert refreshes == [(d, v) for v in range(1, STEPS + 1) for d in (0, 1)]  # rollout only, after each update
    for trained in (x for x in cluster.log if isinstance(x, Trained)):
        at = cluster.log.index(trained)
        for d in (0, 1):  # the refresh follows the update (the fake checks each Generate against its device's version)
            assert cluster.log.index(Shift(d, R, trained.version)) > at
    for part in per_step(cluster.log):
        rollout_events = [
            i for i, x in enumerate(part) if isinstance(x, Generated) and any(r.uid < EVAL_UID for r in x.results)
        ]
        first_judge = next(i for i, x in enumerate(part) if isinstance(x, Judge))
        assert first_judge < rollout_events[-1], "judging waited for the whole rollout"
        last_judged = max(i for i, x in enumerate(part) if isinstance(x, Judged))
        assert isinstance(part[-1], Step) and last_judged < len(part) - 1
        first_backward = next(i for i, x in enumerate(part) if isinstance(x, Accumulate))
        assert first_backward < last_judged, "the backward waited for the last reward"


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(Colocated(1), id="colocated-1dev"),
        pytest.param(
            Disaggregated(4),
            id="disaggregated-4dev",
        ),
    ],
)
def test_slow_evaluation_is_still_reported_with_its_step(policy):
    """Evaluation runs next to the rollout of the following step; here it finishes after that step's update."""
    ctl = controller(policy)
    cluster = run(ctl, eval_last=True)
    assert ctl.done
    assert ctl.accuracy == {v: expected_accuracy(v) for v in range(STEPS + 1)}
    assert [(m["step"], m["heldout_accuracy"]) for m in ctl.metrics] == [
        (step, expected_accuracy(step)) for step in range(1, STEPS + 1)
    ]
    assert len(cluster.trains) == STEPS


def test_a_result_served_by_the_wrong_version_trips_the_controller():
    ctl = controller(Colocated(1))
    with pytest.raises(AssertionError, match=r"step 1, sample \d+: policy v1 served it, -1 behind v0"):
        run(ctl, wrong_version=True)


# -- shiftable ------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [1, 4], ids=lambda n: f"{n}dev")
def test_shiftable_completes_with_the_same_rewards_and_updates(devices):
    ctl = controller(Shiftable(devices, max_batch=4, rollout_tokens=8, judge_tokens=8))
    cluster = run(ctl)
    assert ctl.done and ctl.version == STEPS
    assert ctl.accuracy == {v: expected_accuracy(v) for v in range(STEPS + 1)}
    for m in ctl.metrics:
        assert m["reward_mean"] == 0.5 and m["judge_agreement"] == 1.0 and m["parse_failures"] == 0
        assert m["step_seconds"] >= m["group_wait_s"]["max"] >= m["group_wait_s"]["median"] >= 0
        assert 0 <= m["groups_judged_at_rollout_end"] <= PROMPTS
    assert [cmd.version for cmd, _, _ in cluster.trains] == list(range(STEPS))
    for cmd, rewards, backwards in cluster.trains:
        assert rewards == {u: 1.0 if u % 2 == 0 else 0.0 for u in range(SAMPLES)}
        assert {b.device for b in backwards} <= set(cmd.devices)
        assert sorted(resp[0] for b in backwards for resp in b.shard.response_ids) == list(range(SAMPLES))
    assert sum(isinstance(x, Shift) for x in cluster.log) >= 3  # it moves devices between roles


@pytest.mark.parametrize("make", [lambda: Colocated(3), lambda: Disaggregated(4)], ids=["colocated", "disaggregated"])
def test_events_handled_together_give_the_same_job(make):
    one, together = controller(make()), controller(make())
    a, b = run(one), run(together, batched=True)
    check_results(together, b)
    assert [m["reward_mean"] for m in one.metrics] == [m["reward_mean"] for m in together.metrics]
    assert [(c.version, sorted(r.items())) for c, r, _ in a.trains] == [
        (c.version, sorted(r.items())) for c, r, _ in b.trains
    ]


class Steered(Disaggregated):
    """Disaggregated placement, preempting, with targets a test can override."""

    preempt = True

    def __init__(self) -> None:
        super().__init__(4)
        self.override: dict[int, Role] = {}

    def targets(self, demand):
        return {**super().targets(demand), **self.override}


def test_an_abort_commits_the_device_to_the_role_it_was_aborted_for():
    """A plan that flips back while the abort is in flight must not hand the device new work:
    in the simulator (aborts take no time) that looped abort, judge, abort, ... at one instant."""
    policy = Steered()  # rollout: 0, 1; genrm: 2; train: 3
    ctl = controller(policy)
    cluster = FakeCluster(ctl)
    commands = ctl.start()
    while not any(isinstance(c, Generate) and c.device == 0 for c in commands):
        for c in commands:
            cluster.submit(c)
        commands = [c for e in cluster.ready for c in ctl.handle(e)]
        cluster.ready = []
    for c in commands:
        cluster.submit(c)
    policy.override[0] = G
    assert Abort(0) in ctl.pump()
    cluster.submit(Abort(0))
    policy.override[0] = R  # the plan changes its mind before the abort lands
    after = [c for e in cluster.ready for c in ctl.handle(e)]
    assert Shift(0, G, 0) in after
    assert not any(isinstance(c, Generate | Judge) and c.device == 0 for c in after)


def test_the_plan_sees_a_shifting_device_in_the_role_it_is_heading_to():
    """Seen in its old role (and pinned there), a shifting device got planned back to it
    and shifted straight back on arrival: a third of a simulated cluster's shifts."""
    ctl = controller(Steered())  # rollout: 0, 1; genrm: 2; train: 3
    shifts = [c for c in ctl.start() if isinstance(c, Shift)]
    assert [s.role for s in shifts] == [R, R, G, T]
    roles, pinned = ctl.fleet.layout()
    assert roles == (R, R, G, T) and pinned == frozenset(range(4))


def test_a_judged_backlog_goes_out_in_shares():
    """Judged groups go to the train devices in shares of at most every device's share of
    the step: a backlog handed whole to the few devices training when it arrives would run
    on them alone while devices sent to train next find an empty queue."""
    cluster = run(controller(Disaggregated(4)))  # train: device 3 alone, 4 groups a step
    for _, _, accumulates in cluster.trains:
        assert [len(a.shard.response_ids) // GROUP for a in accumulates] == [1] * PROMPTS  # ceil(4 / 4)
        assert {a.device for a in accumulates} == {3}


def run_until(ctl: Controller, kind: type) -> tuple[FakeCluster, list[Command]]:
    """The job run until the controller first sends a command of ``kind``: the fake cluster, and those commands
    (not submitted)."""
    cluster = FakeCluster(ctl)
    commands = ctl.start()
    while not any(isinstance(c, kind) for c in commands):
        for c in commands:
            cluster.submit(c)
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    return cluster, commands


def in_roles(ctl: Controller) -> tuple[FakeCluster, list[Command]]:
    """The job run until every device holds its role: the fake cluster, and the first rollout's commands."""
    return run_until(ctl, Generate)


def test_a_backlog_is_shared_by_tokens_not_by_groups():
    """Judged samples go to the train devices in even shares of their tokens, a group split
    between devices if need be: the groups judged last hold the longest responses, and whole
    groups would leave one device with the longest backward while the others wait."""
    ctl = controller(Disaggregated(4, {R: 1, G: 1, T: 2}), prompts_per_step=4, group_size=4)
    cluster, _ = in_roles(ctl)
    step = ctl.book
    lengths = [40, 40, 40, 40] + [1] * 12  # group 0 long, groups 1-3 short
    for i, (s, n) in enumerate(zip(step.samples, lengths, strict=True)):
        s.prompt_ids, s.reward = [1] * 8, float(i % 2)
        s.response_ids = [i] + [7] * (n - 1)  # the first token names the sample
    for p in range(4):
        step.queue_group(p)
    dispatched = ctl.train.dispatch(step, ctl.fleet, ctl.version, ctl.policy.train_devices, lambda: 1)
    backwards = [c for c in dispatched if isinstance(c, Accumulate)]
    assert [b.device for b in backwards] == [2, 3]
    took = [[resp[0] for resp in b.shard.response_ids] for b in backwards]
    tokens = [sum(len(p) + len(r) for p, r in zip(b.shard.prompt_ids, b.shard.response_ids, strict=True))
              for b in backwards]  # fmt: skip
    # at most every device's share of the step (4 samples' mean tokens, 75) each: the long group split
    assert took == [[0, 1], [2, 3]] and tokens == [96, 96]
    assert sorted([*took[0], *took[1], *step.queue]) == list(range(16))  # the rest waits, nothing lost
    for b, mine in zip(backwards, took, strict=True):
        assert list(b.shard.advantages) == pytest.approx([1.0 if u % 2 else -1.0 for u in mine], abs=1e-4)


def test_a_group_generated_whole_is_judged_first():
    """A group trains once every member is judged: the judgments of a group generated whole go ahead
    of those queued earlier for groups still generating."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}), per_device=16, judge_per_device=1)
    cluster, commands = in_roles(ctl)
    for c in commands:
        cluster.submit(c)
    work = {r.uid: r for r in cluster.work[0]}  # the rollout device holds all 8 (groups of 2: uids 2p, 2p + 1)
    assert set(range(SAMPLES)) <= set(work)  # (and the held-out evaluation)
    sent: list[int] = []
    for uids in ([0], [2], [4], [6], [3]):  # group 1 (2, 3) is whole after the fifth
        for c in ctl.handle(Generated(0, tuple(work[u] for u in uids))):
            if isinstance(c, Judge):
                sent += [r.uid for r in c.requests]
    assert sent == [0]  # one judgment in flight, the rest queued
    assert [r.uid for r in ctl.scheduler.judge_queue] == [2, 3, 4, 6]
    # the plan sees which judgments run where: those finish on their device
    w, zero = ctl.workload(), ctl.book.by_uid[0]
    assert (w.judge_queued, w.judge_running, w.judge_holders) == (5, 1, 1)
    assert w.judge_read_running == len(zero.prompt_ids) + len(zero.response_ids) > 0
    assert w.judge_read_tokens == sum(len(ctl.book.by_uid[u].prompt_ids) + len(ctl.book.by_uid[u].response_ids)
                                      for u in (0, 2, 3, 4, 6))  # fmt: skip
    # once its device reports it writing, the judgment has read its prompt there: only its verdict is left
    ctl.handle(Progress(1, Role.JUDGE, 0.5, 3, 1, ((0, 3),), prefill_tokens=10, prefill_seconds=0.1))
    w = ctl.workload()
    assert (w.judge_read_running, w.judge_left_running) == (0, ctl.stats.means["judge_tokens"] - 3)
    assert w.judge_written == [3]  # (how long the running judgment may still run depends on what it wrote)
    assert w.judge_read_tokens == sum(len(ctl.book.by_uid[u].prompt_ids) + len(ctl.book.by_uid[u].response_ids)
                                      for u in (2, 3, 4, 6))  # fmt: skip
    for c in ctl.handle(Judged(1, (JudgeResult(0, "VERDICT: yes", False, 5),))):
        if isinstance(c, Judge):
            sent += [r.uid for r in c.requests]
    assert sent == [0, 2]
    assert 0 not in ctl.stats.so_far  # a judged sample's progress is gone with it
    assert ctl.workload().judge_left_running == ctl.stats.means["judge_tokens"]  # judgment 2 has not started
    assert ctl.book.by_uid[0].judge_tokens == 5  # the judgment's length stays with its sample (samples.jsonl)


def test_a_response_still_generating_trains_at_what_it_has_written_so_far():
    """The workload counts a group's responses still generating at their prompt and the tokens they have
    written (the planner adds what its length model expects them still to write), not at a mean length
    that the longest responses of a step, which end last, far exceed."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}), per_device=16)
    in_roles(ctl)
    prompt = ctl.stats.means["prompt_tokens"]
    before = ctl.workload()
    assert before.train_tokens_per_group == pytest.approx(prompt * GROUP)  # nothing written yet
    ctl.handle(Progress(0, R, 0.5, 100, 1, ((0, 100),)))  # sample 0 (group 0) has written 100 tokens
    after = ctl.workload()
    assert after.train_tokens_per_group == pytest.approx(before.train_tokens_per_group + 100 * GROUP / SAMPLES)


class ReasoningJudge(FakeCluster):
    """Judgments of two lengths: 5 tokens for even uids, 95 for odd ones."""

    def submit(self, cmd: Command) -> None:
        super().submit(cmd)
        if isinstance(cmd, Judge):
            d = cmd.device
            self.work[d] = deque(replace(r, tokens=5 + 90 * (r.uid % 2)) for r in self.work[d])


def test_judgment_lengths_are_averaged_over_whole_steps():
    """A judge that reasons writes judgments of very different lengths and the long ones end last: a
    running mean over judgments as they end reads the step's last ones. After a step the planner's
    judgment length is that step's mean; before, the mean of those seen."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}))
    means = after_each_step(ReasoningJudge(ctl), lambda: ctl.stats.means["judge_tokens"])[1:]
    assert means == [pytest.approx(50.0)] * len(means) and len(means) == ctl.spec.steps


def test_what_a_running_judgment_has_left_follows_the_last_steps_lengths():
    """A judge that reasons writes judgments of a long tail: one that has written more than the short
    ones is one of the long ones, with their rest to come, not the mean's. (Judgments of 5 and 95
    tokens: one that wrote 10 has 85 left; one that wrote 2, 50 - 2 on average.)"""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}))
    assert ctl.stats.verdict_left(2) == ctl.stats.means["judge_tokens"] - 2  # no step yet: the prior mean
    after_each_step(ReasoningJudge(ctl), lambda: None)
    assert [ctl.stats.verdict_left(n) for n in (0, 2, 10, 94, 95, 500)] == pytest.approx([50, 48, 85, 1, 1, 1])


def after_each_step(cluster: FakeCluster, measure: Callable[[], object]) -> list[object]:
    """The job run on ``cluster``: ``measure()`` before its first events, then after each step trained."""
    ctl = cluster.ctl
    commands, seen = ctl.start(), []
    while not ctl.done:
        for c in commands:
            cluster.submit(c)
        events = cluster.next_events()
        if not seen:
            seen.append(measure())
        commands = [c for e in events for c in ctl.handle(e)]
        if any(isinstance(e, Trained) for e in events):
            seen.append(measure())
    return seen


class RereadingJudge(FakeCluster):
    """A judge that reads every prompt and response three times over (its template, preemptions): each
    Judged comes with a Progress saying so."""

    def next_events(self) -> list[Event]:
        out = super().next_events()
        for e in [e for e in out if isinstance(e, Judged)]:
            by_uid = self.ctl.book.by_uid  # (judgments come in while a step runs)
            read = sum(len(by_uid[r.uid].prompt_ids) + len(by_uid[r.uid].response_ids) for r in e.results)
            out.insert(out.index(e), Progress(e.device, G, 0.1, 5, len(e.results), prefill_tokens=3 * read))
        return out


class ReportingRollout(FakeCluster):
    """Each Generated comes after a Progress naming its sequences as running, as the engines report them."""

    def __init__(self, ctl: Controller, **fake) -> None:
        super().__init__(ctl, **fake)
        self.reported: set[int] = set()

    def next_events(self) -> list[Event]:
        out = super().next_events()
        for e in [e for e in out if isinstance(e, Generated)]:
            so_far = tuple((r.uid, len(r.output_ids)) for r in e.results)
            out.insert(out.index(e), Progress(e.device, R, 0.1, 5, len(e.results), so_far))
            self.reported |= {uid for uid, _ in so_far}
        return out


def test_progress_is_forgotten_once_a_sequence_ends():
    """What running sequences have written is kept until they end: training samples and held-out
    answers alike leave nothing behind."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}))
    cluster = ReportingRollout(ctl, per_tick=3)
    after_each_step(cluster, lambda: None)
    assert any(uid >= EVAL_UID for uid in cluster.reported) and ctl.accuracy  # held-out answers reported too
    assert ctl.stats.so_far == {}


def test_what_the_judge_reads_again_is_measured_per_step():
    """The planner prices a judgment's prefill at what the judge devices read per token of the judged
    prompts and responses over the last step (1 before any step)."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}))
    seen = after_each_step(RereadingJudge(ctl), lambda: ctl.workload().judge_reread)
    assert seen == [1.0] + [pytest.approx(3.0)] * ctl.spec.steps


def test_a_judgment_weighs_the_context_it_reads():
    """On a GPU a judgment's decode steps cost about its context: a long response's judgment weighs more."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}))
    in_roles(ctl)
    short, long = ctl.book.samples[:2]
    short.prompt_ids, short.response_ids = [1] * 8, [2] * 2
    long.prompt_ids, long.response_ids = [1] * 8, [2] * 80
    assert ctl.scheduler.judge_weight(short.uid) == 8 + 2 and ctl.scheduler.judge_weight(long.uid) == 8 + 80


@pytest.mark.parametrize("rebalance", [True, False])
def test_requests_in_flight_are_rebalanced_once_the_queue_is_empty(rebalance):
    """A rollout device that empties while another still holds its whole share takes half of
    that share over (the sequences with the fewest tokens to re-prefill); off, nothing moves."""
    ctl = controller(Disaggregated(4, {R: 2, G: 1, T: 1}), per_device=SAMPLES, rebalance=rebalance)
    cluster = FakeCluster(ctl)
    commands = ctl.start()
    while not any(isinstance(c, Generate) for c in commands):
        for c in commands:
            cluster.submit(c)
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    for c in commands:
        cluster.submit(c)
    held = {d: [r.uid for r in cluster.work[d]] for d in (0, 1)}
    n = len(held[0])  # the step's samples and the held-out evaluation, half each
    assert n > 2 and len(held[1]) == n and not ctl.scheduler.gen_queue
    ctl.stats.so_far.update({u: 100 - u for u in held[0]})  # the last sent have made the most progress
    done = Generated(1, tuple(cluster.work[1]))
    cluster.work[1].clear()
    aborts = [c for c in ctl.handle(done) if isinstance(c, Abort)]
    if not rebalance:
        assert aborts == []
        return
    assert aborts == [Abort(0, tuple(sorted(held[0], reverse=True)[: n // 2]))]
    cluster.submit(aborts[0])
    [back] = cluster.next_events()
    again = ctl.handle(back)
    assert [(c.device, sorted(r.uid for r in c.requests)) for c in again if isinstance(c, Generate)] == [
        (1, sorted(aborts[0].uids))
    ]
    assert not any(isinstance(c, Abort) for c in again)


def test_prompts_are_rendered_by_the_chat_template_for_rollout_and_evaluation(monkeypatch):
    """The loop formats the task's prompt and hands it to the policy's chat template (a plain function)."""
    chat = lambda prompt: f"<user>{prompt}</user><assistant>"
    for prompt, reference in list(REFERENCE.items()):  # the fake devices answer rendered prompts too
        monkeypatch.setitem(REFERENCE, chat(prompt), reference)
    ctl = controller(Colocated(2), chat=chat)
    cluster = run(ctl)
    check_results(ctl, cluster)
    prompts = {r.uid: r.prompt for c in cluster.log if isinstance(c, Generate) for r in c.requests}
    rendered = [chat(TEMPLATE.format(question=p.question)) for p in TRAIN_SET + HELDOUT]
    assert {p for uid, p in prompts.items() if uid >= EVAL_UID} == set(rendered[len(TRAIN_SET) :])
    assert {p for uid, p in prompts.items() if uid < EVAL_UID} <= set(rendered[: len(TRAIN_SET)])


class FailingUpdates(FakeCluster):
    """The first ``fails`` optimizer steps fail (a member lost): the survivors report ``StepFailed``."""

    def __init__(self, ctl: Controller, fails: int) -> None:
        super().__init__(ctl)
        self.fails = fails

    def submit(self, cmd: Command) -> None:
        if not isinstance(cmd, Step) or self.fails == 0:
            return super().submit(cmd)
        self.fails -= 1
        self.log.append(cmd)
        for d in cmd.devices:
            self.version[d] = -1  # (their train state is not usable: they take the role up again)
        self.ready.append(StepFailed(cmd.devices, cmd.version, "device 9: its process died"))


def drive(cluster: FakeCluster) -> None:
    ctl = cluster.ctl
    commands = ctl.start()
    for _ in range(10_000):
        for c in commands:
            cluster.submit(c)
        if ctl.done:
            return
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    raise AssertionError("the job did not end")


def test_an_optimizer_step_that_fails_is_done_again():
    ctl = controller(Colocated(2))
    cluster = FailingUpdates(ctl, fails=UPDATE_ATTEMPTS - 1)
    drive(cluster)
    assert ctl.version == ctl.spec.steps and cluster.fails == 0
    assert ctl.metrics[0]["recovered"] > 0  # every sample of the first step went through backward again


def test_an_optimizer_step_that_keeps_failing_stops_the_attempt():
    """A step whose devices cannot meet is not retried for ever: the job resumes from its checkpoint."""
    ctl = controller(Colocated(2))
    with pytest.raises(DeviceLostError, match=f"optimizer step of step 1 failed {UPDATE_ATTEMPTS} times in a row"):
        drive(FailingUpdates(ctl, fails=UPDATE_ATTEMPTS))


class LosingWholeSteps(FakeCluster):
    """The first optimizer step loses every member (their processes die, NCCL's watchdog or the driver ends
    them): each is lost, the step fails with no survivor, and each comes back, restarted, later."""

    def __init__(self, ctl: Controller) -> None:
        super().__init__(ctl)
        self.lost_once = False
        self.back: list[Event] = []

    def submit(self, cmd: Command) -> None:
        if not isinstance(cmd, Step) or self.lost_once:
            return super().submit(cmd)
        self.lost_once = True
        self.log.append(cmd)
        for d in cmd.devices:
            self.role[d], self.version[d] = None, -1
            self.work[d].clear()
            self.ready.append(DeviceLost(d, "its process died"))
            self.back.append(DeviceJoined(d))
        self.ready.append(StepFailed((), cmd.version, "every member lost"))

    def next_events(self) -> list[Event]:
        if self.back and not self.ready and not any(self.work.values()):  # (restarted once nothing else is left)
            events, self.back = self.back, []
            return events
        return super().next_events()


@pytest.mark.parametrize("policy", [Colocated(2), Shiftable(3, max_batch=4, rollout_tokens=8, judge_tokens=8)])
def test_a_step_whose_every_member_is_lost_and_restarted_is_done_again(policy):
    ctl = controller(policy)
    cluster = LosingWholeSteps(ctl)
    drive(cluster)
    assert cluster.lost_once and ctl.version == ctl.spec.steps
    assert ctl.metrics[0]["recovered"] > 0  # the step's samples went through backward again


def test_how_long_groups_wait_for_the_judge_is_measured():
    """From a group's last response to its last judgment: what its backward waits for the judge."""
    now = [0.0]
    ctl = Controller(spec(per_device=16), Disaggregated(3, {R: 1, G: 1, T: 1}), genrm(), TRAIN_SET, HELDOUT,
                     lambda: now[0])  # fmt: skip
    cluster, commands = in_roles(ctl)
    for c in commands:
        cluster.submit(c)
    work = {r.uid: r for r in cluster.work[0]}  # groups of 2: uids 2p, 2p + 1
    now[0] = 10.0
    ctl.handle(Generated(0, (work[2], work[3])))  # group 1 whole at 10 s
    now[0] = 13.0
    ctl.handle(Judged(1, (JudgeResult(2, "VERDICT: yes", False, 5), JudgeResult(3, "VERDICT: no", False, 5))))
    now[0] = 20.0
    ctl.handle(Generated(0, tuple(work[u] for u in range(SAMPLES) if u not in (2, 3))))  # the rollout ends
    rec = ctl.book.record
    assert rec.group_waits == [3.0] and rec.groups_judged_at_rollout_end == 1
    assert rec.group_whole_at == {1: 10.0, 0: 20.0, 2: 20.0, 3: 20.0}


def run_until_trained(ctl: Controller) -> FakeCluster:
    """The job up to the first update, handled."""
    cluster = FakeCluster(ctl)
    commands = ctl.start()
    for _ in range(10_000):
        for c in commands:
            cluster.submit(c)
        if ctl.version == 1:
            return cluster
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    raise AssertionError("no update")


def test_only_a_device_holding_its_shard_of_a_sharded_train_state_stops_the_attempt():
    """A sharded trainer's shard is nowhere else while its device stays in the train role after stepping: losing
    that device ends the attempt (the job resumes from its checkpoint). A device that shifted since has written
    its shard to the GPS, and one that joined the role after the step holds none: losing those costs nothing."""
    ctl = controller(Disaggregated(3, {R: 1, G: 1, T: 1}), sharded_train=True)
    run_until_trained(ctl)
    assert [d.shard for d in ctl.fleet.devices] == [False, False, True]  # the train device stays in its role
    ctl.handle(DeviceLost(0, "its process died"))  # a rollout device: its sequences start again elsewhere
    with pytest.raises(DeviceLostError, match="device 2 \\(train\\) was lost holding its shard"):
        ctl.handle(DeviceLost(2, "its process died"))

    ctl = controller(Colocated(2), sharded_train=True)
    cluster = run_until_trained(ctl)
    assert all(d.shard for d in ctl.fleet.devices)
    for e in cluster.next_events():  # every device shifts to the rollout for the next step, its shard to the GPS
        ctl.handle(e)
    assert not any(d.shard for d in ctl.fleet.devices)
    ctl.handle(ShiftDone(1, T, 1, 0.5, 1000))  # back in the train role before the next update: no shard yet
    assert ctl.fleet.devices[1].role is T and not ctl.fleet.devices[1].shard
    ctl.handle(DeviceLost(1, "its process died"))
    assert ctl.fleet.devices[1].lost


def test_a_lockstep_trainer_leaves_every_group_to_the_step():
    """FSDP2 backpropagates at the step: groups handed out before are only buffered, so the planner's workload
    counts them as training still to do, and the step's measured seconds leave its backward out (it is priced as
    training)."""
    for lockstep in (False, True):
        ctl = controller(Colocated(2), lockstep_train=lockstep)
        run_until(ctl, Step)
        groups, w, samples = ctl.spec.prompts_per_step, ctl.workload(), ctl.book.samples
        assert w.train_groups_left == (groups if lockstep else 0)
        if lockstep:  # (the buffered groups at their real tokens, not at a mean of what is not yet buffered)
            real = sum(len(x.prompt_ids) + len(x.response_ids) for x in samples) / len(samples) * GROUP
            assert w.train_tokens_per_group == pytest.approx(real)
    before = ctl.stats.means["step_seconds"]
    ctl.handle(Trained((0, 1), 1, {"loss": 0.0}, 5.0, 400, 4.5))
    assert ctl.stats.means["step_seconds"] == pytest.approx(before + 0.2 * (0.5 - before))


class SteeredTrain(Steered):
    """``Steered``, training on the devices its targets put in the train role, as a planning policy (shiftable)."""

    wants_view = True

    def train_devices(self) -> tuple[int, ...]:
        return tuple(d for d, r in sorted(self.targets(None).items()) if r is T)


def test_the_optimizer_step_waits_for_the_train_devices_it_needs():
    """A trainer whose state one device cannot hold (train.min_devices=2): every backward done on the one train
    device, the step waits, and the workload tells the planner how many it needs; it runs once a second joins."""
    policy = SteeredTrain()  # rollout: 0, 1; genrm: 2; train: 3
    ctl = controller(policy, min_train_devices=2)
    cluster = FakeCluster(ctl)
    commands = ctl.start()
    while not (ctl.book is not None and ctl.book.record.accumulated == SAMPLES and not commands and not cluster.ready):
        for c in commands:
            cluster.submit(c)
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    assert not any(isinstance(x, Step) for x in cluster.log)
    assert ctl.workload().train_devices_needed == 2
    policy.override[2] = T  # the judge device, idle now, joins the train role
    commands = ctl.pump()
    assert commands == [Shift(2, T, 0)]
    cluster.submit(commands[0])
    step = [c for e in cluster.next_events() for c in ctl.handle(e) if isinstance(c, Step)]
    assert [s.devices for s in step] == [(2, 3)]
    assert ctl.workload().train_devices_needed == 0  # (the step runs)


def test_a_static_layout_that_lost_a_train_device_steps_on_those_left():
    """Nothing brings a static layout's lost train device back before it rejoins: the step waits for no more
    than the train devices not lost (a planning policy waits for min_train_devices of every device not lost)."""
    ctl = controller(Disaggregated(4, {R: 1, G: 1, T: 2}), min_train_devices=2)

    def needed(ctl: Controller) -> int:
        return train_needed(ctl.fleet, ctl.policy.wants_view, ctl.policy.train_devices, ctl.spec.min_train_devices)

    assert needed(ctl) == 2
    ctl.fleet.lose(3)
    assert needed(ctl) == 1
    planned = controller(SteeredTrain(), min_train_devices=3)
    planned.fleet.lose(3)
    assert needed(planned) == 3


@pytest.mark.parametrize("needed", [1, 2, 3])
def test_a_lost_device_is_not_planned_into_a_role(needed):
    """A device lost for good holds no role the planner could count: planned into the train role, it made a
    step that needs as many train devices wait for one that never comes (the plan saw enough of them)."""
    ctl = controller(Shiftable(4, max_batch=4, rollout_tokens=8, judge_tokens=8), min_train_devices=needed)
    cluster = FakeCluster(ctl)
    for c in ctl.start():
        cluster.submit(c)
    cluster.ready = [e for e in cluster.ready if getattr(e, "device", None) != 0]  # (it died before answering)
    commands = ctl.handle(DeviceLost(0, "its process died"))
    for _ in range(10_000):
        for c in commands:
            assert getattr(c, "device", None) != 0, f"a command to the lost device: {c}"
            cluster.submit(c)
        if ctl.done:
            break
        commands = [c for e in cluster.next_events() for c in ctl.handle(e)]
    assert ctl.done and ctl.version == STEPS
    assert all(0 not in cmd.devices and len(cmd.devices) >= needed for cmd, _, _ in cluster.trains)
