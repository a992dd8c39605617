"""Overlapping steps (``max_staleness`` > 0) over the fake devices of ``test_controller`` and over the simulator.

Step s's rollout may begin once version s - 1 - max_staleness is out: the steps in flight keep their books apart
(their requests' uids apart by ``STEP_UID``), the oldest is trained first, a sample never lags more than
max_staleness versions behind the one its step trains, evaluation runs on the version it names, and a step after
which a checkpoint is due is trained before the next begins."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest

from pivotrl.config import load_config
from pivotrl.control.book import token_runs
from pivotrl.control.controller import Controller
from pivotrl.control.evaluation import EVAL_UID
from pivotrl.control.messages import (
    Abort,
    Aborted,
    Command,
    DeviceJoined,
    DeviceLost,
    Generate,
    Generated,
    GenResult,
    Role,
    Shift,
    Step,
    Trained,
)
from pivotrl.control.modes import Colocated, Disaggregated
from pivotrl.control.shiftable import Shiftable
from pivotrl.control.spec import STEP_UID
from pivotrl.sim.run import run_simulation
from tests.control.test_controller import (
    HELDOUT,
    SAMPLES,
    TRAIN_SET,
    FakeCluster,
    expected_accuracy,
    genrm,
    spec,
)
from tests.control.test_controller import run as run_fake
from tests.sim.test_run import EXAMPLE, SMALL

STEPS = 5


class OverlapCluster(FakeCluster):
    """The fake devices, where judging and rollout of later steps may run beside an update."""

    def submit(self, cmd: Command) -> None:
        if isinstance(cmd, Step):  # (the fake refuses an update while judging runs: on-policy, nothing does)
            busy = {d: q for d, q in self.work.items() if self.role[d] is Role.JUDGE}
            for d in busy:
                self.work[d], busy[d] = type(busy[d])(), self.work[d]
            super().submit(cmd)
            for d, queue in busy.items():
                self.work[d] = queue
            return
        super().submit(cmd)


def controller(policy, k: int, **overrides) -> Controller:
    clock = itertools.count()
    job = spec(steps=STEPS, max_staleness=k, **overrides)
    return Controller(job, policy, genrm(), TRAIN_SET, HELDOUT, lambda: float(next(clock)))


def run(ctl: Controller) -> OverlapCluster:
    return run_fake(ctl, batched=True, cluster_type=OverlapCluster)


def policies():
    return [
        Colocated(2),
        Disaggregated(4),
        Shiftable(4, max_batch=4, rollout_tokens=8, judge_tokens=8),
    ]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_steps_overlap_within_the_bound_and_train_in_order(policy, k):
    ctl = controller(policy, k)
    records = []
    cluster = OverlapCluster(ctl)
    commands = ctl.start()
    in_flight = []
    while not ctl.done:
        for c in commands:
            cluster.submit(c)
        in_flight.append(len(ctl.books))
        commands = ctl.handle_all(cluster.next_events())
        records += ctl.finished_steps
        ctl.finished_steps.clear()
    assert max(in_flight) == k + 1  # as many steps in flight as the bound allows
    assert [cmd.version for cmd, _, _ in cluster.trains] == list(range(STEPS))  # one update a step, in order
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    for rec in records:
        lags = [rec.step - 1 - s.policy_version for s in rec.samples]
        assert min(lags) >= 0 and max(lags) <= k
        assert all(s.reward == (1.0 if s.uid % 2 == 0 else 0.0) for s in rec.samples)  # the fake's verdicts
    rows = ctl.metrics
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    for m in rows:  # each evaluation ran on the version it names (the fake answers by the version serving it)
        assert m["heldout_accuracy"] == expected_accuracy(m["step"])
        assert m["staleness_max"] <= k and sum(m["staleness"].values()) == SAMPLES
        assert m["staleness_mean"] == sum(int(lag) * n for lag, n in m["staleness"].items()) / SAMPLES
    assert rows[0]["staleness"] == {"0": SAMPLES}  # the first step is on-policy: nothing older exists
    assert any(m["staleness_max"] > 0 for m in rows)  # later steps were generated beside an update
    for _, _, backwards in cluster.trains:  # every sample of its step exactly once
        uids = sorted(resp[0] % STEP_UID for b in backwards for resp in b.shard.response_ids)
        assert uids == list(range(SAMPLES))


def test_the_next_rollout_runs_beside_the_update_in_a_static_split():
    """Disaggregated with max_staleness 1: the fully asynchronous split. The rollout devices generate step 2
    while step 1 is judged and trained."""
    ctl = controller(Disaggregated(4), 1)
    cluster = run(ctl)
    first_step = next(i for i, x in enumerate(cluster.log) if isinstance(x, Step))
    sent = [x for x in cluster.log[:first_step] if isinstance(x, Generate)]
    uids = {r.uid for g in sent for r in g.requests if r.uid < EVAL_UID}
    assert {u // STEP_UID for u in uids} == {1, 0}  # step 1's slot (1 % 2) and step 2's (2 % 2)
    assert all(g.version == 0 for g in sent)


def test_the_on_policy_job_sends_what_it_sent_before():
    """max_staleness 0: one step at a time (its uids the samples' own, no second slot) and no lag reported."""
    ctl = controller(Disaggregated(4), 0)
    cluster = run(ctl)
    assert all(r.uid < SAMPLES or r.uid >= EVAL_UID for g in cluster.log if isinstance(g, Generate) for r in g.requests)
    assert "staleness" not in ctl.metrics[0]


def test_a_checkpoint_is_taken_with_no_step_in_flight():
    ctl = controller(Disaggregated(4), 2, checkpoint_every=2)
    cluster = OverlapCluster(ctl)
    commands, taken = ctl.start(), []
    while not ctl.done:
        for c in commands:
            cluster.submit(c)
        commands = ctl.handle_all(cluster.next_events())
        if ctl.checkpoint_due is not None:
            state = ctl.checkpoint()
            taken.append((state["step"], state["version"], sorted(ctl.books)))
            ctl.checkpoint_due = None
    # after steps 2 and 4 (not 5, the last): steps 3 and 4 (then 5) begin only once the step before is trained
    assert taken == [(2, 2, [3, 4]), (4, 4, [5])]


def test_a_resumed_overlapping_run_trains_what_the_uninterrupted_one_does():
    whole = controller(Disaggregated(4), 1, checkpoint_every=2)
    cluster = run(whole)
    resumed = Controller(spec(steps=STEPS, max_staleness=1, checkpoint_every=2), Disaggregated(4), genrm(),
                         TRAIN_SET, HELDOUT, lambda: 0.0, resume=checkpoint_after(2))  # fmt: skip
    again = run(resumed)
    assert again.trains[0][0].version == 2
    assert [m["step"] for m in resumed.metrics] == [2, 3, 4, 5]  # (step 2's row waited for its evaluation)
    for a, b in zip(cluster.trains[2:], again.trains, strict=True):
        assert a[1] == b[1]  # the same rewards by uid
        assert sorted(r[0] for x in a[2] for r in x.shard.response_ids) == sorted(
            r[0] for x in b[2] for r in x.shard.response_ids
        )


def checkpoint_after(step: int) -> dict:
    ctl = controller(Disaggregated(4), 1, checkpoint_every=2)
    cluster = OverlapCluster(ctl)
    commands = ctl.start()
    while True:
        for c in commands:
            cluster.submit(c)
        commands = ctl.handle_all(cluster.next_events())
        if ctl.checkpoint_due == step:
            return ctl.checkpoint()


def test_a_sequence_moved_off_a_device_an_update_left_behind_begins_again():
    """Its tokens so far are of the older version; every device it could go on on holds the newer one."""
    ctl = controller(Disaggregated(4), 1, per_device=8)  # rollout: devices 0 and 1
    cluster = OverlapCluster(ctl)
    commands = ctl.start()
    while not any(isinstance(e, Trained) for e in cluster.log):  # (the commands of the update's event not sent)
        for c in commands:
            cluster.submit(c)
        commands = ctl.handle_all(cluster.next_events())
    assert ctl.version == 1 and ctl.fleet[0].version == 0  # device 0 not yet refreshed
    # as if device 0 had taken a sequence of step 3 (begun at the update) before it, and written two tokens
    (sent,) = ctl.scheduler.dispatch_gen([0], 0)  # (the evaluation of v1 first, then step 3's)
    first = next(r for r in sent.requests if r.uid < EVAL_UID)
    moved = replace(first, output_ids=[5, 6], logprobs=[-0.1, -0.2])
    ctl.fleet.abort(0)
    ctl.handle(Aborted(0, tuple(moved if r is first else r for r in sent.requests), (), 0.0))
    queued = {r.uid: r for r in ctl.scheduler.gen_queue}
    assert queued[first.uid].output_ids == [] and queued[first.uid].logprobs == []
    assert queued[first.uid].seed == first.seed and queued[first.uid].prompt == first.prompt
    assert ctl._book_of(first.uid).by_uid[first.uid].migrations == 1


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "shiftable", "shiftable partial_rollout=true"])
def test_simulated_lags_stay_within_the_bound_whatever_the_lengths(tmp_path, mode, k):
    """The simulator's devices, response lengths drawn at random (a seed, a spread, a tail): every sample lags
    at most k versions (the book asserts it as each comes in; the rows say it)."""
    rng = random.Random(f"{mode}{k}")
    lengths = rng.choice(
        [["sim.lengths.kind=lognormal", f"sim.lengths.sigma={rng.uniform(0.3, 1.5):.2f}"],
         ["sim.lengths.kind=pareto", f"sim.lengths.alpha={rng.uniform(1.1, 2.5):.2f}", "sim.lengths.minimum=32"]]
    )  # fmt: skip
    mode, *more = mode.split()
    job = [*SMALL, "steps=4", f"mode={mode}", *more, f"max_staleness={k}", f"seed={rng.randrange(100)}", *lengths]
    run_simulation(load_config(EXAMPLE, job), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= k for r in rows) and any(r["staleness_max"] > 0 for r in rows)
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 8 * 4  # (SMALL: 8 prompts of 4 a step)
    assert all(0 <= s["step"] - 1 - s["policy_version"] <= k for s in samples)


class LosingARolloutDevice(OverlapCluster):
    """At the first update, a rollout device dies with sequences of the next steps on it; it comes back once
    nothing else is left to do."""

    def __init__(self, ctl: Controller) -> None:
        super().__init__(ctl)
        self.lost: int | None = None
        self.back: list = []

    def next_events(self):
        if self.lost is None and any(isinstance(e, Trained) for e in self.log):
            busy = [d for d in range(len(self.role)) if self.role[d] is Role.ROLLOUT and self.work[d]]
            if busy:
                d = self.lost = busy[0]
                self.role[d], self.version[d] = None, -1
                self.work[d].clear()
                self.back.append(DeviceJoined(d))
                return [DeviceLost(d, "its process died")]
        if self.back and not self.ready and not any(self.work.values()):
            events, self.back = self.back, []
            return events
        return super().next_events()


def test_a_device_lost_with_two_steps_in_flight_loses_nothing():
    ctl = controller(Disaggregated(4), 1, per_device=8)
    cluster = LosingARolloutDevice(ctl)
    commands = ctl.start()
    while not ctl.done:
        for c in commands:
            cluster.submit(c)
        commands = ctl.handle_all(cluster.next_events())
    assert cluster.lost is not None and ctl.version == STEPS
    assert sum(m["recovered"] for m in ctl.metrics) > 0
    for _, rewards, backwards in cluster.trains:  # every sample of every step trained once, with its reward
        assert sorted(resp[0] % STEP_UID for b in backwards for resp in b.shard.response_ids) == list(range(SAMPLES))
        assert sorted(u % STEP_UID for u in rewards) == list(range(SAMPLES))
    assert all(m["staleness_max"] <= 1 for m in ctl.metrics)


@pytest.mark.parametrize(
    ("marks", "tokens", "version", "want"),
    [
        ([], 9, 1, [(0, 1)]),  # never moved
        ([], 0, 1, [(0, 1)]),  # an empty response
        ([(3, 1), (5, 1)], 9, 1, [(0, 1)]),  # moved between devices of one version
        ([(5, 0)], 9, 1, [(0, 0), (5, 1)]),  # an update in between: two runs
        ([(2, 0), (4, 1), (6, 1)], 8, 2, [(0, 0), (2, 1), (6, 2)]),
    ],
)
def test_token_runs_tell_which_version_wrote_which_tokens(marks, tokens, version, want):
    assert token_runs(marks, tokens, version) == want


def until_the_first_update(ctl: Controller) -> tuple[OverlapCluster, list[Command]]:
    """The fake devices up to the first update, and the commands its event brought (not sent)."""
    cluster = OverlapCluster(ctl)
    commands = ctl.start()
    while True:
        for c in commands:
            cluster.submit(c)
        events = cluster.next_events()
        commands = ctl.handle_all(events)
        if any(isinstance(e, Trained) for e in events):
            return cluster, commands


def test_a_partial_rollout_goes_on_with_the_newer_weights_and_records_them():
    """partial_rollout: a rollout device an update left behind hands its sequences over at once (Abort, then
    its reload) instead of finishing them; a sequence keeps its tokens, marked with the version that wrote them
    (a resuming engine's migration audit skips it), and its sample records both versions."""
    ctl = controller(Disaggregated(4), 2, per_device=8, partial_rollout=True)  # (step 3 still generates)
    cluster, commands = until_the_first_update(ctl)
    busy = [d for d in (0, 1) if cluster.work[d]]
    assert busy and [c.device for c in commands if isinstance(c, Abort)] == busy  # everything they run, at once
    d = busy[0]
    first = next(r for r in cluster.work[d] if r.uid < EVAL_UID)
    running = [cluster.requests[r.uid] for r in cluster.work[d]]
    moved = replace(cluster.requests[first.uid], output_ids=[5, 6], logprobs=[-0.1, -0.2])
    commands = ctl.handle(Aborted(d, tuple(moved if r.uid == first.uid else r for r in running), (), 0.0))
    assert Shift(d, Role.ROLLOUT, 1) in commands  # reloaded at once
    queued = {r.uid: r for r in ctl.scheduler.gen_queue}[first.uid]
    assert queued.output_ids == [5, 6] and queued.prefix_version == 0
    book = ctl._book_of(first.uid)
    # as if a device of v1 ran it to its end, two tokens more
    ctl.scheduler.gen_queue.remove(queued)
    ctl.handle(Generated(d, (GenResult(first.uid, [7, 8], [5, 6, 7, 8], [-0.1] * 4, "the answer is 2", "stop", 1),)))
    sample = book.by_uid[first.uid]
    assert sample.policy_version == 0 and sample.token_versions == [(0, 0), (2, 1)]


def test_partial_rollout_is_off_unless_asked():
    """Without it the stale devices finish what they run (no Abort) and take no more."""
    ctl = controller(Disaggregated(4), 2, per_device=8)
    cluster, commands = until_the_first_update(ctl)
    assert any(cluster.work[d] for d in (0, 1)) and not [c for c in commands if isinstance(c, Abort)]
    assert not {0, 1} & set(ctl.fleet.ready(Role.ROLLOUT))
