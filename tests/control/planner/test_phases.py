"""The per-phase estimate: when each phase of the rest of the step ends with an allocation, case by case."""

from __future__ import annotations

import dataclasses
import math
from itertools import pairwise

import pytest

from pivotrl.control.planner import (
    Estimate,
    LengthModel,
    PhaseModel,
    Planner,
    RoleProfile,
    Workload,
    estimate,
    fmt_alloc,
    summarize,
)
from pivotrl.control.planner.alloc import ON_TIME
from pivotrl.control.planner.phases import JudgeEnd, RolloutEnd, gen_rate, now_and_later
from tests.control.planner.cases import (
    EARLY,
    JUDGE_BURST,
    MAX_BATCH,
    PER_SEQ,
    REWARDS_IN,
    TAIL,
    G,
    R,
    T,
    alloc,
    generation,
    judgments,
    profiles,
)


def test_estimate_of_the_tail_by_hand():
    # 2 sequences, ~1000 tokens left each, one per device at 20 tok/s: rollout ends at 50 s.
    # 602 judgments x 100 tokens = 60200 tokens. One judge device (400 tok/s) does 20020 by 50.05 s,
    # when the 3 rollout devices join after their 0.05 s shift: 4 x 400 tok/s (batches of 32)
    # = 1600 tok/s for 40180 -> 25.1125 s.
    e = estimate(TAIL, profiles(), alloc(3, 1, 0), MAX_BATCH)
    assert (e.rollout_end, e.judge_end, e.backward_end, e.total) == pytest.approx((50.0, 75.1625, 0.0, 75.1625))
    assert e.tail and e.seqs == 2
    assert e.worst_rollout_end == pytest.approx((2048 - 600) / 20)


def test_rollout_tail_is_priced_at_the_context_it_reads():
    # one sequence 640 tokens in, every response 1,000 long: 360 steps left, at contexts 50 + 640 + 0 ..
    # 359, so 50 + 820 on average; a step costs 10 ms + 1 ms a sequence + 1 us a token of context
    lm = LengthModel(min_samples=4)
    for _ in range(64):
        lm.observe(1000)
    p = profiles()
    p.lengths = lm
    p.rollout = RoleProfile(step_base=0.01, step_per_seq=0.001, step_per_kv=1e-6)
    w = Workload(rollout_remaining=[640], judge_future=1, prompt_tokens_mean=50)
    e = estimate(w, p, alloc(1, 1, 0), MAX_BATCH)
    assert e.rollout_end == pytest.approx(360 * (0.011 + 1e-6 * (50 + 640 + 180)), rel=1e-3)
    # a sequence as far along with a longer prompt reads more at every step
    longer = estimate(Workload(rollout_remaining=[640], judge_future=1, prompt_tokens_mean=2050), p, alloc(1, 1, 0), 32)
    assert longer.rollout_end - e.rollout_end == pytest.approx(360 * 1e-6 * 2000, rel=1e-3)


def test_judgments_running_finish_where_they_run():
    # 64 judgments of 100 tokens: waiting, 4 judge devices share them (16 each, 0.0655 s a step:
    # 100 steps, 6.55 s); running on one device, the other 3 have nothing to take (64 at the batch cap
    # of 32: 2 x 100 steps of 0.08 s, 16 s)
    p = profiles()
    waiting = Workload(judge_queued=64, judge_tokens_mean=100)
    running = Workload(judge_queued=64, judge_running=64, judge_holders=1, judge_tokens_mean=100)
    assert estimate(waiting, p, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(100 * (0.05 + 15 * PER_SEQ))
    assert estimate(running, p, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(64 * 100 / 400)
    assert estimate(running, p, alloc(0, 1, 0), MAX_BATCH).judge_end == pytest.approx(64 * 100 / 400)
    # half of them waiting: the 3 idle devices take those, while the holder finishes its own
    half = Workload(judge_queued=64, judge_running=32, judge_holders=1, judge_tokens_mean=100)
    assert estimate(half, p, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(100 * 0.08)


def test_judge_devices_taken_away_hand_their_running_judgments_back():
    """An allocation with fewer judge devices than hold running judgments keeps only the stayers' share
    held; the leavers' go back to the queue, for any device that comes to judge. Four holders of 32
    each, one kept, and the rollout's device joining the judge at once: the stayer finishes its 32 in
    8 s, and the 96 others are shared (not all 128 held by the one that stays, 32 s)."""
    p = profiles(prior_mean=4.0, prior_max=8.0)  # the rollout's last sequence ends at once
    w = Workload(rollout_remaining=[1], judge_future=1, judge_queued=128, judge_running=128, judge_holders=4,
                 judge_tokens_mean=100)  # fmt: skip
    end = estimate(w, p, alloc(1, 1, 0), MAX_BATCH).judge_end
    assert 8.0 < end < 0.7 * 32
    # every holder kept: each finishes its own 32 (8 s), whatever joins
    assert estimate(w, p, alloc(1, 4, 0), MAX_BATCH).judge_end == pytest.approx(8.0, rel=0.05)


def test_judgments_running_cost_what_they_have_left_at_their_holders_pace():
    """What a running judgment has still to read is priced at its holder's prefill rate and its verdict's
    rest at its holder's batch, whatever the devices beyond the holders: judge devices with nothing to
    take shorten nothing (idle, they would look useful and stay out of the train role)."""
    p = profiles()
    p.judge = generation(prefill_rate=1000.0)
    running = dict(judge_queued=64, judge_running=64, judge_holders=2, judge_tokens_mean=100)
    # 32 judgments each, at the batch cap: 400 tok/s; 3,200 tokens to write and 2,000 to read each
    unread = Workload(**running, judge_read_tokens=4000.0, judge_read_running=4000.0)
    ends = [estimate(unread, p, alloc(0, n, 0), MAX_BATCH).judge_end for n in (2, 8, 32)]
    assert ends == pytest.approx([3200 / 400 + 2000 / 1000] * 3)
    # twice as many, half of their verdicts written and every prompt read: 3,200 tokens each are left
    started = Workload(**(running | {"judge_queued": 128, "judge_running": 128}), judge_left_running=6400)
    assert estimate(started, p, alloc(0, 8, 0), MAX_BATCH).judge_end == pytest.approx(3200 / 400)


def test_judgments_read_again_cost_their_reads_again():
    """``judge_reread`` (measured: the template, preempted judgments) multiplies what every judgment left
    reads: the prefill of 64 judgments of 1,000 tokens at 1,000 tokens/s on one device, twice over."""
    p = profiles()
    p.judge = generation(prefill_rate=1000.0)
    once = Workload(judge_queued=64, judge_tokens_mean=100, judge_read_tokens=64_000.0)
    twice = Workload(judge_queued=64, judge_tokens_mean=100, judge_read_tokens=64_000.0, judge_reread=2.0)
    ends = [estimate(w, p, alloc(0, 1, 0), MAX_BATCH).judge_end for w in (once, twice)]
    assert ends == pytest.approx([64 * 100 / 400 + 64.0, 64 * 100 / 400 + 128.0])
    with pytest.raises(ValueError, match="judge_reread"):
        Workload(judge_reread=0.0)


def test_the_responses_ending_last_are_judged_at_their_own_context():
    """A response still generating is judged at the context it will have: with a paged judge cache the
    longest, ending last, run in small batches, so a rollout whose responses are long leaves more
    judging behind it than the mean context would say."""
    p = profiles()
    p.judge = RoleProfile(step_base=0.05, step_per_seq=PER_SEQ, step_per_kv=1e-6, prefill_rate=1e12)
    w = Workload(rollout_remaining=[100] * 32, rollout_groups=list(range(32)), judge_future=32,
                 judge_tokens_mean=50, prompt_tokens_mean=100)  # fmt: skip
    s = summarize(w, p, judge_kv=4_000)
    context = [point.context for point in s.rollout.grid.points]
    assert context[-1] > context[0] and s.judge.left_context is not None
    fits_at = [4_000 // (c + 25) for c in context]
    assert fits_at[-1] < fits_at[0] <= MAX_BATCH  # the cache binds, the last ones most
    paged = PhaseModel(s, p, MAX_BATCH).estimate((1, 1, 0))
    slots = PhaseModel(summarize(w, p), p, MAX_BATCH).estimate((1, 1, 0))
    assert paged.judge_end > slots.judge_end


def test_what_the_judge_holds_when_the_rollout_ends_stays_there():
    """A judge device takes what its cache holds (32 judgments here) and keeps it: the rollout devices
    handed over at the rollout's end share only the rest, so with a backlog of more than a cache-full
    the judge ends a cache-full's time after the rollout at the earliest (32 judgments of 4,000 tokens
    at 400 tokens/s: 320 s), not that backlog shared out over all the devices."""
    w = Workload(rollout_remaining=[0] * 64, rollout_groups=[i // 4 for i in range(64)], judge_future=64,
                 judge_tokens_mean=4000)  # fmt: skip
    e = estimate(w, profiles(), alloc(3, 1, 0), MAX_BATCH)
    assert e.judge_end - e.rollout_end > 0.9 * 32 * 4000 / 400


def test_a_paged_judge_cache_holds_fewer_of_the_long_judgments():
    """With ``judge_kv`` the judge's batch is what its KV cache holds at the context of the judgments
    left (what they read and half a verdict), the engine's slots at most."""
    p = profiles()
    waiting = Workload(judge_queued=64, judge_tokens_mean=100, judge_read_tokens=64 * 950.0)
    slots = estimate(waiting, p, alloc(0, 1, 0), MAX_BATCH).judge_end
    assert slots == pytest.approx(64 * 100 / 400)  # 32 at once
    assert estimate(waiting, p, alloc(0, 1, 0), MAX_BATCH, judge_kv=1e6).judge_end == pytest.approx(slots)
    # 16,000 tokens hold 16 judgments of 1,000: steps of 16 at 0.05 + 15 * PER_SEQ s
    small = estimate(waiting, p, alloc(0, 1, 0), MAX_BATCH, judge_kv=16_000).judge_end
    assert small == pytest.approx(64 * 100 * (0.05 + 15 * PER_SEQ) / 16)
    with pytest.raises(ValueError, match="judge_kv"):
        Planner(2).plan(0.0, {0: G, 1: G}, {}, set(), waiting, p, MAX_BATCH, judge_kv=0)


def test_tail_bound_dominates_with_few_sequences():
    few = Workload(rollout_remaining=[0, 0], judge_future=2)
    many = Workload(rollout_remaining=[0] * 200, judge_future=200)
    for n in (2, 4, 8):
        e = estimate(few, profiles(), alloc(n, 1, 0), MAX_BATCH)
        assert e.tail and e.rollout_end == pytest.approx(1000 / 20)  # one sequence's speed, however many devices
    both = estimate(few, profiles(), alloc(1, 1, 0), MAX_BATCH)  # on one device, each step carries both
    assert both.rollout_end == pytest.approx(2000 / generation().rate(2))
    e = estimate(many, profiles(), alloc(2, 1, 0), MAX_BATCH)
    assert not e.tail and e.rollout_end == pytest.approx(200 * 1000 / (2 * 400))


PHASE = {R: "rollout_end", G: "judge_end", T: "backward_end"}


@pytest.mark.parametrize(
    "workload", [TAIL, JUDGE_BURST, REWARDS_IN, EARLY], ids=["tail", "burst", "rewards-in", "early"]
)
@pytest.mark.parametrize("role", [R, G, T], ids=lambda r: r.value)
def test_more_devices_never_slow_a_phase(workload, role):
    ends = []
    for n in range(1, 9):
        counts = {R: 2, G: 2, T: 2, role: n}
        ends.append(getattr(estimate(workload, profiles(), counts, MAX_BATCH), PHASE[role]))
    assert all(b <= a + 1e-9 for a, b in pairwise(ends)), ends


NEVER = [
    pytest.param(EARLY, alloc(0, 2, 2), "rollout_end", id="rollout-work-no-rollout-device"),
    pytest.param(JUDGE_BURST, alloc(4, 0, 0), "judge_end", id="judge-work-only-idle-rollout-devices"),
    pytest.param(REWARDS_IN, alloc(2, 2, 0), "backward_end", id="train-work-no-train-device"),
]


@pytest.mark.parametrize(("workload", "counts", "phase"), NEVER)
def test_a_role_with_work_and_no_device_never_ends(workload, counts, phase):
    e = estimate(workload, profiles(), counts, MAX_BATCH)
    assert getattr(e, phase) == math.inf and e.total == math.inf


def test_devices_of_a_phase_ending_later_join_the_next_one():
    e = estimate(EARLY, profiles(), alloc(4, 0, 0), MAX_BATCH)  # judge and train get the rollout devices
    assert e.rollout_end < e.judge_end < e.backward_end < e.total < math.inf


def test_a_lockstep_trainer_backpropagates_every_group_once_judging_ends():
    """FSDP2 trains every group at the step: no backward before the last judgment, all of it after, on the train
    devices there are then; a trainer that backpropagates each judged group at once starts with the first."""
    ready = dataclasses.replace(JUDGE_BURST, train_groups_ready=4)
    free = estimate(ready, profiles(), alloc(0, 2, 2), MAX_BATCH)
    lock = estimate(dataclasses.replace(ready, lockstep_train=True), profiles(), alloc(0, 2, 2), MAX_BATCH)
    assert free.train_from == 0.0 < free.judge_end == lock.judge_end == lock.train_from
    # 8 groups x 500 tokens at 1000 tok/s a device, from the judge's end: the 2 train devices alone for the
    # 0.05 s the judge devices take to join them, then all 4
    assert lock.backward_end == pytest.approx(lock.judge_end + 0.05 + (4000 - 2 * 1000 * 0.05) / 4000)
    assert free.backward_end < lock.backward_end


def test_estimate_describes_itself():
    e = estimate(TAIL, profiles(), alloc(3, 1, 0), MAX_BATCH)
    assert isinstance(e, Estimate) and e.count(G) == 1
    assert e.describe().startswith("r3 j1 t0: rollout 50.00s judge 75.16s")
    assert fmt_alloc(alloc(2, 1, 1)) == "r2 j1 t1"


def test_devices_handed_to_the_next_phase_pay_their_shift():
    # the 3 rollout devices reach the judge 2 s after the rollout ends, not at once: the single
    # judge device works alone 2 s longer (800 tokens), which the four then finish at 1600 tok/s
    free, costly = (estimate(TAIL, profiles(shift=s), alloc(3, 1, 0), MAX_BATCH) for s in (0.0, 2.0))
    assert costly.judge_end - free.judge_end == pytest.approx(2.0 - 800 / 1600)
    # a judge device already there pays nothing, so moving early stops being free of charge in comparison
    early = estimate(TAIL, profiles(shift=2.0), alloc(1, 3, 0), MAX_BATCH)
    assert early.judge_end < costly.judge_end


def test_judging_includes_reading_the_responses():
    # 400 judgments of 100 tokens on 2 devices at 400 tok/s: 50 s. Each also reads a 2000-token
    # prompt + response at 4000 tok/s (0.5 s of a device = 200 tokens of decode at 400 tok/s)
    queued = Workload(judge_queued=400, judge_tokens_mean=100, judge_read_tokens=400 * 2000)
    p = profiles()
    p.judge = generation(prefill_rate=4000)
    e = estimate(queued, p, alloc(0, 2, 0), MAX_BATCH)
    assert e.judge_end == pytest.approx((400 * 100 + 400 * 2000 * 400 / 4000) / 800)


def test_rollout_devices_holding_no_sequence_do_not_speed_it_up():
    # 8 sequences running on 2 of 4 rollout devices: the other 2 could judge without slowing the rollout
    spread = Workload(rollout_remaining=[100] * 8, judge_future=8, rollout_holders=2)
    fresh = Workload(rollout_remaining=[100] * 8, judge_future=8)  # who runs them unknown: any device may
    p = profiles()
    assert estimate(spread, p, alloc(4, 0, 0), MAX_BATCH).rollout_end == pytest.approx(
        estimate(spread, p, alloc(2, 2, 0), MAX_BATCH).rollout_end
    )
    assert (
        estimate(fresh, p, alloc(4, 0, 0), MAX_BATCH).rollout_end
        < estimate(fresh, p, alloc(2, 2, 0), MAX_BATCH).rollout_end
    )


def test_sequences_beyond_the_slots_wait_before_their_tail():
    # 128 fresh sequences on 2 devices of 32 slots: the last ones start once half the work is done
    queued = Workload(rollout_remaining=[0] * 128, rollout_queued=64, judge_future=128)
    e = estimate(queued, profiles(prior_mean=100, prior_max=200), alloc(2, 0, 0), MAX_BATCH)
    room = estimate(queued, profiles(prior_mean=100, prior_max=200), alloc(4, 0, 0), MAX_BATCH)
    assert e.rollout_end > room.rollout_end * 1.5


def test_groups_train_once_judged():
    # the same work left, but 8 of 16 groups already judged: their backward runs while judging goes on
    base = dict(judge_queued=80, judge_tokens_mean=100, train_groups_left=16, train_tokens_per_group=2000)
    none = estimate(Workload(**base), profiles(), alloc(0, 2, 2), MAX_BATCH)
    half = estimate(Workload(**base, train_groups_ready=8), profiles(), alloc(0, 2, 2), MAX_BATCH)
    assert half.judge_end == none.judge_end and half.backward_end < none.backward_end


def test_the_last_groups_backward_is_shared_by_its_samples():
    # one group of 16 samples left, judged as judging ends: 16 train devices take a sample each
    base = dict(judge_queued=1, judge_tokens_mean=100, train_groups_left=1, train_tokens_per_group=16_000)
    whole = estimate(Workload(**base), profiles(), alloc(0, 1, 16), MAX_BATCH)
    shared = estimate(Workload(**base, train_group_size=16), profiles(), alloc(0, 1, 16), MAX_BATCH)
    assert whole.backward_end - whole.judge_end == pytest.approx(16.0, rel=0.05)  # 16,000 tokens at 1000/s
    assert shared.backward_end - shared.judge_end == pytest.approx(1.0, rel=0.05)  # a sample on each device
    # 4 train devices, and the judge device once it has shifted over (0.05 s): the group on 5 devices
    few = estimate(Workload(**base, train_group_size=16), profiles(), alloc(0, 1, 4), MAX_BATCH)
    assert few.backward_end - few.judge_end == pytest.approx(0.05 + (16_000 - 4 * 0.05 * 1000) / 5000, rel=1e-3)


def test_the_optimizer_step_waits_for_train_devices_shifting_in():
    base = Workload(train_groups_left=1, train_tokens_per_group=1000, train_groups_ready=1, train_group_size=4)
    p = profiles()
    on_time = PhaseModel(summarize(base, p), p, MAX_BATCH).estimate((0, 0, 4))
    late = PhaseModel(summarize(base, p), p, MAX_BATCH).estimate((0, 0, 4), ((0, 0.0), (0, 0.0), (2, 30.0)))
    assert on_time.backward_end < 1.0 and late.backward_end == pytest.approx(30.0)


def test_an_optimizer_step_that_needs_more_train_devices_never_ends_with_fewer():
    """A trainer whose state one device cannot hold steps on ``train_devices_needed`` devices: counted are the
    train devices and those the phases still working hand over when they end; idle ones stay where they are."""
    step_due = Workload(step_seconds=1.0, train_devices_needed=3)
    assert estimate(step_due, profiles(), alloc(0, 0, 2), MAX_BATCH).total == math.inf
    assert estimate(step_due, profiles(), alloc(1, 1, 1), MAX_BATCH).total == math.inf  # (idle roles)
    assert estimate(step_due, profiles(), alloc(0, 0, 3), MAX_BATCH).total == pytest.approx(1.0)
    # while the rollout and the judge work, their devices join the train role when they end
    early = dataclasses.replace(EARLY, train_devices_needed=4)
    assert estimate(early, profiles(), alloc(3, 1, 0), MAX_BATCH).total < math.inf
    assert estimate(dataclasses.replace(early, train_devices_needed=5), profiles(), alloc(3, 1, 0),
                    MAX_BATCH).total == math.inf  # fmt: skip


def test_groups_generated_whole_during_the_rollout_train_before_it_ends():
    # 16 groups, 15 of them with one short member left and one with a long one: knowing the groups,
    # the estimate trains the 15 on the train device while the long member runs (from about 11 s to
    # the rollout's end at 80 s: 69 s of the 320 s backward), and all 4 devices share the rest: a
    # quarter of those 69 s saved
    lm = LengthModel(min_samples=4)
    for n in [50] * 60 + [2000] * 4:
        lm.observe(n)
    p = profiles()
    p.lengths = lm
    base = dict(
        rollout_remaining=[40] * 15 + [1000],
        judge_future=16,
        judge_tokens_mean=20,
        train_groups_left=16,
        train_tokens_per_group=20_000,
    )
    blind = estimate(Workload(**base), p, alloc(2, 1, 1), MAX_BATCH)
    known = estimate(Workload(**base, rollout_groups=list(range(16))), p, alloc(2, 1, 1), MAX_BATCH)
    assert known.rollout_end == pytest.approx(blind.rollout_end)
    assert blind.backward_end - known.backward_end == pytest.approx(69 / 4, rel=0.1)


def test_the_judges_slots_are_its_own_not_the_rollouts():
    """The judge's batch is bounded by its own slots whatever the rollout's: with 64 sequences on 2
    rollout devices (32 each), a rollout cap of 256 or 512 a device changes no estimate."""
    p = profiles()
    p.judge = RoleProfile(step_base=0.05, step_per_seq=PER_SEQ, step_per_kv=1e-6, prefill_rate=1e12)
    w = Workload(rollout_remaining=[100] * 64, rollout_groups=[i // 4 for i in range(64)], judge_future=64,
                 judge_queued=8, judge_read_tokens=8 * 300.0, judge_tokens_mean=50, prompt_tokens_mean=100)  # fmt: skip
    for kv in (None, 1e12):
        assert estimate(w, p, alloc(2, 1, 1), (256, 4), kv) == estimate(w, p, alloc(2, 1, 1), (512, 4), kv)


def test_the_longest_judgment_not_the_mean_ends_a_judge_that_reasons():
    # 200 judgments on 4 devices: 16.1 s of work in batches of 50 (25,800 tokens at 1,600 tok/s). With a
    # tail, one of them likely runs to 3000 tokens (2611 expected for the longest), alone at 0.05 s a token
    w = Workload(judge_queued=200, judge_tokens_mean=129)
    alike, tailed = profiles(), profiles()
    alike.judgments, tailed.judgments = judgments(False), judgments(True)
    assert estimate(w, alike, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(16.12, abs=0.01)
    longest = tailed.judgments.expected_longest({0: 200})
    assert longest == pytest.approx(2611, abs=1)
    assert estimate(w, tailed, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(longest * 0.05)
    # running, the longest is what the judgments that have written most may still write: past 100 tokens,
    # every one of them runs to 3000
    running = dataclasses.replace(w, judge_running=200, judge_holders=4, judge_written=[160] * 200)
    assert estimate(running, tailed, alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx((3000 - 160) * 0.05)
    # before a judgment is seen, the planner knows no tail: one judgment's mean
    assert estimate(w, profiles(), alloc(0, 4, 0), MAX_BATCH).judge_end == pytest.approx(16.12, abs=0.01)


def test_responses_still_generating_end_in_their_longest_judgment():
    # 64 responses at 500 of 1000 tokens end together at 40 s; their judgments take one judgment's time at a
    # full batch after it (129 tokens at 0.08 s, 10.3 s), or with a tail the longest of them alone
    w = Workload(rollout_remaining=[500] * 64, rollout_groups=[i // 8 for i in range(64)], judge_future=64,
                 judge_tokens_mean=129)  # fmt: skip
    ends = {}
    for tail in (False, True):
        p = profiles()
        p.lengths, p.judgments = LengthModel(min_samples=4), judgments(tail)
        for _ in range(100):
            p.lengths.observe(1000)
        e = estimate(w, p, alloc(2, 2, 0), MAX_BATCH)
        assert e.rollout_end == pytest.approx(40.0)
        ends[tail] = e.judge_end - e.rollout_end
    assert ends[False] == pytest.approx(129 * 0.08, rel=0.01)
    assert ends[True] > 1000 * 0.05  # the longest of a few dozen judgments: most likely one of 3000 tokens


# -- the model's phases, one at a time ---------------------------------------------------------------


def model(workload: Workload, **kw) -> PhaseModel:
    p = profiles(**kw)
    return PhaseModel(summarize(workload, p), p, MAX_BATCH)


def test_each_device_of_a_role_shares_its_sequences_up_to_one_each():
    # 64 sequences on 2 devices: 32 each, at the batch cap (400 tok/s); 4 on 8 devices: half a sequence each
    assert gen_rate(generation(), 64, 2, MAX_BATCH) == pytest.approx(400.0)
    assert gen_rate(generation(), 4, 8, MAX_BATCH) == pytest.approx(0.5 * 20.0)
    assert now_and_later(4, (0, 0.0)) == [(0.0, 4)]
    assert now_and_later(4, (1, 2.5)) == [(0.0, 3), (2.5, 1)]


def test_the_rollout_alone():
    m = model(TAIL)
    assert m.rollout(3, (0, 0.0)) == m.rollout(3, (0, 0.0))
    end = m.rollout(3, (0, 0.0))
    assert end.end == pytest.approx(50.0) and end.tail and end.hands_over
    assert len(end.reached) == 8 and end.reached[-1] == pytest.approx(end.end)  # the grid, ending with it
    assert m.rollout(0, (0, 0.0)).end == math.inf  # work and no device
    # every rollout device still on its way: the rollout starts when they arrive
    assert m.rollout(3, (3, 2.0)).end == pytest.approx(52.0)
    done = model(JUDGE_BURST).rollout(3, (0, 0.0))
    assert (done.end, done.worst, done.hands_over) == (0.0, 0.0, False)  # nothing left: its devices idle


def test_judging_alone_after_the_rollout():
    m = model(TAIL)
    rollout = m.rollout(3, (0, 0.0))
    judge = m.judge((3, 1, 0), ON_TIME, rollout)
    assert judge.end == pytest.approx(75.1625) and judge.takes_rollout  # (as the estimate by hand)
    assert m.judge((3, 0, 0), ON_TIME, m.rollout(3, (0, 0.0))).end > rollout.end  # the rollout's devices judge
    assert model(REWARDS_IN).judge((0, 2, 2), ON_TIME, RolloutEnd(0.0, 0.0)) == JudgeEnd()  # nothing to judge


def test_the_backward_alone_after_judging():
    m = model(JUDGE_BURST)
    rollout = m.rollout(0, (0, 0.0))
    judge = m.judge((0, 2, 2), ON_TIME, rollout)
    end, first = m.backward((0, 2, 2), ON_TIME, rollout, judge)
    assert first <= judge.end < end  # the first group trains while the rest is judged, the last after
    assert model(TAIL).backward((3, 1, 0), ON_TIME, rollout, judge) == (0.0, math.inf)  # nothing to train
    late = ((0, 0.0), (0, 0.0), (2, 1000.0))
    assert m.backward((0, 2, 2), late, rollout, judge)[0] == pytest.approx(1000.0)  # the step waits for them


def test_the_estimate_puts_the_phases_together():
    m = model(JUDGE_BURST)
    rollout = m.rollout(0, (0, 0.0))
    judge = m.judge((0, 2, 2), ON_TIME, rollout)
    backward_end, train_from = m.backward((0, 2, 2), ON_TIME, rollout, judge)
    e = m.estimate((0, 2, 2))
    assert (e.rollout_end, e.judge_end, e.backward_end, e.train_from) == (0.0, judge.end, backward_end, train_from)
    assert e.total == max(judge.end, backward_end) + JUDGE_BURST.step_seconds
