"""The simulator driver and its modeled engine: lengths, migration, KV memory, the slice grid."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from pivotrl.config import ConfigError, load_config
from pivotrl.control.messages import (
    Abort,
    Aborted,
    Accumulate,
    Accumulated,
    Generate,
    Generated,
    GenParams,
    GenRequest,
    Judge,
    JudgeRequest,
    Progress,
    Role,
    Shift,
    ShiftDone,
    Step,
    Trained,
    TrainShard,
)
from pivotrl.errors import UserError
from pivotrl.sim.costs import RooflineCosts, steps_within
from pivotrl.sim.driver import SimDriver, StallError
from pivotrl.sim.engine import ModeledEngine, SimSeq
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.measured import MeasuredCosts
from pivotrl.sim.models import MODELS
from pivotrl.sim.run import build
from tests.sim.test_measured import POLICY, PROFILE

PARAMS = GenParams(max_new_tokens=4096)
H100 = RooflineCosts(GPUS["H100"])
QWEN7 = MODELS["Qwen2.5-7B"]


def driver(*overrides: str) -> SimDriver:
    base = ["sim.gpus=2", "sim.slice_s=2", "rollout.max_new_tokens=4096"]
    return SimDriver(build(load_config(None, [*base, *overrides])).spec)


def requests(n: int, params: GenParams = PARAMS, first: int = 0) -> tuple[GenRequest, ...]:
    return tuple(GenRequest(uid, f"q{uid}", seed=1000 + uid, params=params) for uid in range(first, first + n))


def shifted(d: SimDriver, role: Role, *devices: int) -> None:
    for dev in devices:
        d.submit(Shift(dev, role, 0))
    got: set[int] = set()
    while got != set(devices):
        got |= {e.device for e in d.next_events()}


def drain(d: SimDriver) -> dict[int, list[int]]:
    """Run until every sequence is reported; uid -> output ids."""
    out = {}
    while True:
        try:
            events = d.next_events()
        except StallError:
            return out
        for e in events:
            if isinstance(e, Generated):
                out.update({r.uid: r.output_ids for r in e.results})


def test_lengths_are_fixed_by_seed_and_uid_and_survive_migration():
    plain = driver()
    shifted(plain, Role.ROLLOUT, 0, 1)
    plain.submit(Generate(0, requests(8), 0))
    want = drain(plain)
    assert len(want) == 8 and len({len(v) for v in want.values()}) > 1  # drawn, not all alike

    moved = driver()
    shifted(moved, Role.ROLLOUT, 0, 1)
    moved.submit(Generate(0, requests(8), 0))
    first = moved.next_events()  # one slice on device 0 ...
    assert isinstance(first[0], Progress) and first[0].tokens > 0
    moved.submit(Abort(0))  # ... then everything moves to device 1 with its tokens so far
    [aborted] = [e for e in moved.next_events() if isinstance(e, Aborted)]
    done_early = {r.uid for e in first if isinstance(e, Generated) for r in e.results}
    assert {r.uid for r in aborted.gen} | done_early == set(range(8))
    assert all(len(r.output_ids) > 0 and len(r.prompt_ids) == 512 for r in aborted.gen)
    moved.submit(Generate(1, aborted.gen, 0))
    reprefill, *rest = moved.next_events()
    assert reprefill.device == 1 and reprefill.prefill_tokens == sum(512 + len(r.output_ids) for r in aborted.gen)
    got = {r.uid: r.output_ids for e in rest for r in e.results} | drain(moved)
    assert {uid: len(v) for uid, v in got.items()} == {uid: len(v) for uid, v in want.items() if uid not in done_early}


def test_a_partial_abort_takes_only_the_named_sequences():
    """Rebalancing: the named sequences come back with their tokens so far, the device runs on
    with the others, and every sequence ends at its own length wherever it finishes."""
    plain = driver()
    shifted(plain, Role.ROLLOUT, 0, 1)
    plain.submit(Generate(0, requests(8), 0))
    want = drain(plain)

    d = driver()
    shifted(d, Role.ROLLOUT, 0, 1)
    d.submit(Generate(0, requests(8), 0))
    first = d.next_events()
    done_early = {r.uid for e in first if isinstance(e, Generated) for r in e.results}
    asked = tuple(sorted(set(range(8)) - done_early))[:3]
    d.submit(Abort(0, asked))
    events = d.next_events()
    [aborted] = [e for e in events if isinstance(e, Aborted)]
    finished = {r.uid for e in events if isinstance(e, Generated) for r in e.results}
    assert {r.uid for r in aborted.gen} | (finished & set(asked)) == set(asked)
    assert all(len(r.output_ids) > 0 for r in aborted.gen)
    d.submit(Generate(1, aborted.gen, 0))
    got = drain(d)
    assert set(got) | done_early | finished == set(range(8))
    lengths = {r.uid: len(r.output_ids) for e in (*first, *events) if isinstance(e, Generated) for r in e.results}
    assert lengths | {uid: len(v) for uid, v in got.items()} == {uid: len(v) for uid, v in want.items()}
    assert d.devices[0].engine is not None and not d.devices[0].engine.has_work


def test_modeled_engine_take_leaves_the_rest_running():
    e = ModeledEngine(H100, QWEN7, 1, capacity=8)
    for uid, target in enumerate((50, 80, 120)):
        e.add(SimSeq(uid, 100, 0, target, None), 0.0)
    e.add(SimSeq(9, 100, 0, 60, None), 0.0)  # waits: admitted with the others, it runs too
    e.advance(0.2)
    k = e.k
    [(seq, so_far)] = e.take({1, 7})
    assert seq.uid == 1 and so_far == e.generated(seq) == k + 1 and e.load == 3
    done = e.advance(100.0)
    assert sorted(s.uid for s in done) == [0, 2, 9] and e.k == 119 and not e.has_work


def test_lengths_differ_by_job_seed_and_follow_the_distribution():
    a, b = driver(), driver("seed=1")
    lengths = []
    for d in (a, b):
        shifted(d, Role.ROLLOUT, 0, 1)
        d.submit(Generate(0, requests(64), 0))
        lengths.append(sorted(len(v) for v in drain(d).values()))
    assert lengths[0] != lengths[1]
    median = lengths[0][32]
    assert 400 < median < 2500  # the config's lognormal median is 1024


def test_kv_memory_limits_the_batch():
    """Qwen2.5-32B on one A100: ~9 GB of HBM left for 8.7k-token slots, a handful of sequences."""
    d = driver("sim.gpu=A100", "sim.policy_model=Qwen2.5-32B", "rollout.max_new_tokens=8192", "rollout.max_batch=64",
               "sim.kv_cache=reserved")  # fmt: skip
    cap = d.spec.capacity(Role.ROLLOUT)
    assert 0 < cap < 8 and cap == RooflineCosts(GPUS["A100"]).max_batch(MODELS["Qwen2.5-32B"], 1, 512 + 8192)
    shifted(d, Role.ROLLOUT, 0)
    d.submit(Generate(0, requests(20, GenParams(8192)), 0))
    drain(d)
    rollout = [s for s in d.slices() if s.role == "rollout"]
    assert max(s.args["batch"] for s in rollout) == cap
    roomy = driver("rollout.max_new_tokens=8192", "rollout.max_batch=64")
    shifted(roomy, Role.ROLLOUT, 0)
    roomy.submit(Generate(0, requests(20, GenParams(8192)), 0))
    drain(roomy)
    assert max(s.args["batch"] for s in roomy.slices() if s.role == "rollout") == 20


def test_a_model_that_does_not_fit_is_a_user_error():
    with pytest.raises(UserError, match="tensor_parallel: Qwen3-235B-A22B with .* does not fit on 1 x H100"):
        build(load_config(None, ["sim.policy_model=Qwen3-235B-A22B"]))
    build(load_config(None, ["sim.policy_model=Qwen3-235B-A22B", "sim.judge_model=Qwen2.5-14B", "sim.instance_gpus=8",
                             "sim.gpus=8"]))  # fmt: skip


def test_slices_end_on_a_shared_grid_or_when_the_engine_runs_dry():
    d = driver("sim.slice_s=2")
    shifted(d, Role.ROLLOUT, 0, 1)
    d.submit(Generate(0, requests(4), 0))
    d.submit(Generate(1, requests(4, first=4), 0))
    ends = []
    while True:
        try:
            events = d.next_events()
        except StallError:
            break
        progress = [e for e in events if isinstance(e, Progress)]
        assert progress
        ends.append((d.clock(), len(progress)))
    on_grid = [t for t, _ in ends if abs(t / 2 - round(t / 2)) < 1e-9]
    assert len(on_grid) >= len(ends) - 2  # only each device's last report is off the grid (it ran dry)
    assert any(n == 2 for _, n in ends)  # both devices report together


def test_work_arriving_mid_slice_is_planned_again_from_that_moment():
    d = driver("sim.slice_s=10")
    shifted(d, Role.ROLLOUT, 0)
    shifted(d, Role.JUDGE, 1)
    d.submit(Generate(0, requests(2, GenParams(200)), 0))
    d.submit(Judge(1, (JudgeRequest(99, "q", "1", "[300 tokens] answer 1", 5, GenParams(64)),)))
    first = d.next_events()  # the judgment ends first, mid-slice of device 0
    assert first[0].device == 1 and d.clock() < 10
    d.submit(Generate(0, requests(2, GenParams(200), first=2), 0))  # device 0 is in its slice
    got = drain(d)
    assert sorted(got) == [0, 1, 2, 3]


def test_judgments_parse_with_the_jobs_genrm_and_a_capped_one_has_no_verdict():
    d = driver("sim.judge_output_len=48", "judge.max_new_tokens=48", "sim.yes_probability=1")
    shifted(d, Role.JUDGE, 0)
    d.submit(Judge(0, (JudgeRequest(1, "q", "1", "[10 tokens] answer 1", 5, GenParams(48)),)))
    [_, judged] = d.next_events()
    [r] = judged.results
    assert r.truncated and r.text == "" and r.tokens == 48
    d2 = driver("sim.yes_probability=1", "sim.slice_s=30", "judge.max_new_tokens=1024")
    shifted(d2, Role.JUDGE, 0)
    d2.submit(Judge(0, (JudgeRequest(1, "q", "1", "[10 tokens] answer 1", 5, GenParams(1024)),)))
    [_, judged] = d2.next_events()
    assert judged.results[0].text == "VERDICT: yes" and judged.results[0].tokens == 512


def test_a_reasoning_judge_writes_lognormal_judgments_fixed_by_the_request():
    """sim.judge_output_sigma spreads the judgments' lengths about judge_output_len; each is drawn from the
    request's seed, so the same judgment has the same length wherever it runs."""

    def lengths(*overrides: str) -> list[int]:
        d = driver("sim.slice_s=1000", "judge.max_new_tokens=4096", *overrides)
        shifted(d, Role.JUDGE, 0)
        reqs = tuple(JudgeRequest(uid, "q", "1", "[10 tokens] answer 1", 7 + uid, GenParams(4096)) for uid in range(64))
        d.submit(Judge(0, reqs))
        got: dict[int, int] = {}
        while len(got) < len(reqs):
            for e in d.next_events():
                got.update((r.uid, r.tokens) for r in getattr(e, "results", ()))
        return [got[uid] for uid in range(64)]

    assert set(lengths()) == {512}
    spread = lengths("sim.judge_output_sigma=0.9")
    assert spread == lengths("sim.judge_output_sigma=0.9")
    assert 300 < statistics.median(spread) < 850 and min(spread) < 256 and max(spread) > 1024
    with pytest.raises(ConfigError, match="judge_output_sigma: expected a number >= 0, got -1"):
        driver("sim.judge_output_sigma=-1")


def test_commands_for_the_wrong_role_or_version_are_refused():
    d = driver()
    shifted(d, Role.ROLLOUT, 0)
    with pytest.raises(RuntimeError, match="holds policy v0, requests need v1"):
        d.submit(Generate(0, requests(1), 1))
    with pytest.raises(RuntimeError, match="cannot serve judge requests"):
        d.submit(Judge(0, (JudgeRequest(1, "q", "1", "a", 5, GenParams(8)),)))
    d.submit(Generate(0, requests(1), 0))
    with pytest.raises(RuntimeError, match="shift to train with sequences in flight"):
        d.submit(Shift(0, Role.TRAIN, 0))


def test_the_engine_jumps_from_event_to_event():
    """Cost-model calls grow with the sequences that finish, not with the tokens decoded."""
    calls = []

    class Counting(RooflineCosts):
        def decode_span(self, *args):
            calls.append(args)
            return super().decode_span(*args)

    e = ModeledEngine(Counting(GPUS["H100"]), QWEN7, 1, capacity=32)
    rng = random.Random(0)
    for uid in range(32):
        e.add(SimSeq(uid, 512, 0, rng.randint(1000, 8000), None), 0.0)
    finished = e.advance(1e9)
    assert len(finished) == 32 and e.tokens == sum(s.target for s in finished) and not e.has_work
    assert len(calls) < 40


def test_the_engine_counts_the_context_its_decode_steps_read():
    # a prompt of 10 and 5 tokens: the prefill makes the first, 4 decode steps read 11, 12, 13 and 14
    # tokens; beside it, a prompt of 20 and 3 tokens reads 21 and 22. The first call stops after the
    # first decode step: a run of steps cut short by an event counts what it read too
    e = ModeledEngine(H100, QWEN7, 1, capacity=8)
    e.add(SimSeq(0, 10, 0, 5, None), 0.0)
    e.add(SimSeq(1, 20, 0, 3, None), 0.0)
    first = H100.prefill(QWEN7, 1, 30, 15) + H100.decode_step(QWEN7, 1, 2, 16)
    e.advance(first * 1.001)
    assert (e.k, e.kv_read) == (1, 11 + 21)
    e.advance(1e9)
    assert e.kv_read == 11 + 12 + 13 + 14 + 21 + 22 and not e.has_work


def test_paged_cache_admits_what_fits_and_preempts_the_last_admitted():
    # 10 sequences of 500 prompt tokens in 4,000 tokens of cache: 7 fit at once (3,960 with the 1%
    # watermark); as they grow the cache fills, the last admitted goes back to the queue with its tokens
    e = ModeledEngine(H100, QWEN7, 1, capacity=64, kv_tokens=4000)
    for uid in range(10):
        e.add(SimSeq(uid, 500, 0, 300 + 10 * uid, None), 0.0)
    e.advance(1e-9)
    assert len(e.running) == 0  # nothing commits before its step ends
    e.advance(0.5)
    assert 0 < len(e.running) <= 7 and e.k > 0
    assert e._ctx + len(e.running) * e.k <= 4000  # never more tokens than the cache holds
    done = e.advance(1e9)
    assert sorted(s.uid for s in done) == list(range(10)) and not e.has_work
    assert e.preempted > 0
    assert e.tokens == sum(300 + 10 * uid for uid in range(10))  # a preempted sequence loses no token
    assert e.prefill_tokens > 10 * 500  # but re-reads the ones it had made


def test_an_ample_paged_cache_runs_as_fixed_slots():
    def run(**kw) -> tuple[float, list[int]]:
        e = ModeledEngine(H100, QWEN7, 1, capacity=8, **kw)
        for uid in range(20):
            e.add(SimSeq(uid, 256, 0, 100 + 37 * uid, None), 0.0)
        done = e.advance(1e9)
        return e.t, [s.uid for s in done]

    assert run() == run(kv_tokens=10**7)


def test_paged_snapshot_and_restore_replay_preemptions():
    e = ModeledEngine(H100, QWEN7, 1, capacity=64, kv_tokens=3000)
    for uid in range(12):
        e.add(SimSeq(uid, 256, 0, 200 + 37 * uid, None), 0.0)
    snap = e.snapshot()
    a = [s.uid for s in e.advance(30.0)], e.t, e.tokens, e.preempted
    e.restore(snap)
    b = [s.uid for s in e.advance(2.0)] + [s.uid for s in e.advance(30.0)], e.t, e.tokens, e.preempted
    assert a == b and a[3] > 0


def test_a_paged_cache_reads_a_groups_beginning_once_while_it_stays_cached():
    # judgments of 1,000-token prompts whose first 700 tokens their group shares
    def judgment(uid: int, group: int) -> SimSeq:
        return SimSeq(uid, 1000, 0, 50, None, group=group, shared=700)

    e = ModeledEngine(H100, QWEN7, 1, capacity=8, kv_tokens=100_000)
    e.add(judgment(0, 7), 0.0)
    e.advance(1e9)
    alone = e.prefill_seconds
    assert e.prefill_tokens == 1000
    e.add(judgment(1, 7), e.t)  # its group's beginning read before: only its own 300 tokens
    e.add(judgment(2, 8), e.t)  # another group's: all of it
    e.advance(1e9)
    assert e.prefill_tokens == 1000 + 300 + 1000
    # the rest still attends to the beginning: dearer than a prompt of 300, cheaper than one of 1,000
    rest = e.prefill_seconds - alone
    assert H100.prefill(QWEN7, 1, 1300, 1000) < rest < H100.prefill(QWEN7, 1, 2000, 1000)
    # in one prefill pass the first of a group reads the beginning for the others
    e.add(judgment(3, 9), e.t)
    e.add(judgment(4, 9), e.t)
    e.advance(1e9)
    assert e.prefill_tokens == 2300 + 1000 + 300
    # without a paged cache nothing is kept
    fixed = ModeledEngine(H100, QWEN7, 1, capacity=8)
    for uid in range(3):
        fixed.add(judgment(uid, 7), 0.0)
        fixed.advance(1e9)
    assert fixed.prefill_tokens == 3000


def test_a_beginning_no_sequence_holds_gives_way_to_new_ones_least_recently_read_first():
    # 2,400 tokens of cache: two groups' beginnings (700 each) do not fit beside a running sequence of 1,000
    # and more, one does
    e = ModeledEngine(H100, QWEN7, 1, capacity=8, kv_tokens=2_400)
    for uid, group in ((0, 1), (1, 2)):
        e.add(SimSeq(uid, 1000, 0, 50, None, group=group, shared=700), e.t)
        e.advance(1e9)
    assert list(e._cached) == [1, 2]  # (read in that order, none running)
    e.add(SimSeq(2, 1000, 0, 900, None), e.t)  # a sequence of no group, running long
    e.advance(e.t + 0.5)
    e.add(SimSeq(3, 1000, 0, 50, None, group=2, shared=700), e.t)
    e.advance(e.t + 1e-6)  # (a pass that does not complete gives nothing up)
    assert list(e._cached) == [1, 2]
    e.advance(1e9)
    assert e.prefill_tokens == 1000 + 1000 + 1000 + 300  # group 2 kept (read last), group 1 given up first
    assert list(e._cached) == [2]
    # a beginning a running sequence holds is never given up, and a snapshot keeps what is cached
    e = ModeledEngine(H100, QWEN7, 1, capacity=8, kv_tokens=2_500)
    e.add(SimSeq(0, 1000, 0, 400, None, group=1, shared=700), 0.0)
    e.advance(0.2)
    snap = e.snapshot()
    e.add(SimSeq(1, 1000, 0, 50, None, group=1, shared=700), e.t)
    e.advance(e.t + 1)
    assert e.prefill_tokens == 1000 + 300
    e.restore(snap)
    assert list(e._cached) == [1] and e._holding[1] == 1 and e.prefill_tokens == 1000


def test_paged_capacity_counts_the_mean_context_not_the_longest():
    job = ("sim.gpu=A100", "sim.policy_model=Qwen2.5-32B", "rollout.max_new_tokens=8192", "rollout.max_batch=64")
    paged, reserved = driver(*job), driver(*job, "sim.kv_cache=reserved")
    kv = RooflineCosts(GPUS["A100"]).kv_tokens(MODELS["Qwen2.5-32B"], 1)
    spec = paged.spec
    assert spec.kv_tokens(Role.ROLLOUT) == kv and reserved.spec.kv_tokens(Role.ROLLOUT) is None
    assert spec.capacity(Role.ROLLOUT) == kv // spec.rollout_decode_context > reserved.spec.capacity(Role.ROLLOUT)
    shifted(paged, Role.ROLLOUT, 0)
    paged.submit(Generate(0, requests(40, GenParams(8192)), 0))
    assert len(drain(paged)) == 40


def test_a_paged_instance_must_hold_its_longest_sequence_alone():
    with pytest.raises(UserError, match="does not fit"):
        build(load_config(None, ["sim.gpu=A100", "sim.policy_model=Qwen2.5-32B", "rollout.max_new_tokens=64000"]))


def test_kv_cache_names_what_is_allowed():
    with pytest.raises(ConfigError, match="kv_cache: expected one of paged, reserved, got .virtual."):
        load_config(None, ["sim.kv_cache=virtual"])


def test_engine_snapshot_and_restore_replay_the_same_plan():
    e = ModeledEngine(H100, QWEN7, 1, capacity=8)
    for uid in range(12):
        e.add(SimSeq(uid, 256, 0, 100 + 37 * uid, None), 0.0)
    snap = e.snapshot()
    a = [s.uid for s in e.advance(3.0)], e.t, e.tokens
    e.restore(snap)
    b = [s.uid for s in e.advance(1.0)] + [s.uid for s in e.advance(3.0)], e.t, e.tokens
    assert a == b


@pytest.mark.parametrize("costs", ["roofline", "measured"])
def test_steps_within_matches_a_plain_bisection(costs):
    c, model = (H100, QWEN7) if costs == "roofline" else (MeasuredCosts.from_dict(PROFILE), POLICY)
    rng = random.Random(1)
    for _ in range(200):
        batch, context = rng.randint(1, 512), rng.uniform(1, 8000)
        seconds, limit = rng.uniform(0, 30), rng.randint(0, 5000)
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if c.decode_span(model, 1, batch, context, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        assert steps_within(c, model, 1, batch, context, seconds, limit) == lo


def test_a_control_plane_that_loops_in_zero_virtual_time_is_stopped_with_a_message():
    """An Abort and a Generate to one device in the same round, again and again: no time passes."""
    d = driver()
    shifted(d, Role.ROLLOUT, 0)
    reqs = requests(2)
    with pytest.raises(StallError, match=r"repeats itself without progress: 1000 rounds .* Abort\(0\), Generate\(0\)"):
        for _ in range(2000):
            d.submit(Abort(0))
            d.submit(Generate(0, reqs, 0))
            [aborted] = [e for e in d.next_events() if isinstance(e, Aborted)]
            reqs = aborted.gen or reqs


@pytest.mark.parametrize("react", [0.0, 5.0])
def test_completions_within_the_reaction_time_are_handled_together(react):
    # a 1.5B judge loads faster than the 7B policy: the two shifts end at different instants
    d = driver("sim.slice_s=10", f"sim.react_s={react}", "sim.judge_model=Qwen2.5-1.5B")
    d.submit(Shift(0, Role.ROLLOUT, 0))
    d.submit(Shift(1, Role.JUDGE, 0))
    first = d.next_events()
    if react == 0.0:
        assert [e.device for e in first] == [1]  # the judge's, alone, when it lands
        assert d.clock() == pytest.approx(first[0].seconds)
        first += d.next_events()
    else:
        assert sorted(e.device for e in first) == [0, 1]  # one batch, handled when the later lands
    assert d.clock() == pytest.approx(max(e.seconds for e in first))


def shift_seconds(spread: dict[str, float], seed: int = 0, devices: int = 400) -> list[float]:
    """Seconds of a first load into train on each of ``devices`` devices under a measured profile."""
    spec = driver().spec
    costs = MeasuredCosts.from_dict({**PROFILE, "spread": spread})
    d = SimDriver(dataclasses.replace(spec, costs=costs, devices=devices, tp=1, seed=seed))
    for dev in range(devices):
        d.submit(Shift(dev, Role.TRAIN, 0))
    done: dict[int, float] = {}
    while len(done) < devices:
        done |= {e.device: e.seconds for e in d.next_events() if isinstance(e, ShiftDone)}
    return [done[dev] for dev in range(devices)]


def test_a_spread_draws_each_operation_about_its_cost_by_the_jobs_seed():
    flat = shift_seconds({})
    assert len(set(flat)) == 1
    drawn = shift_seconds({"shift": 0.5})
    mean = statistics.fmean(drawn)
    assert mean == pytest.approx(flat[0], rel=0.1)  # about the cost, not above it
    assert statistics.pstdev(drawn) / mean == pytest.approx(0.5, rel=0.2)
    assert shift_seconds({"shift": 0.5}) == drawn and shift_seconds({"shift": 0.5}, seed=1) != drawn
    assert shift_seconds({"accumulate": 0.5, "optimizer": 0.5}) == flat  # other kinds leave shifts alone


def test_a_new_train_group_meets_once_and_is_kept_while_its_set_holds():
    """The step of a set of train devices other than the last step's pays the group's start (its process
    group made); the next step of the same set does not; one device meets nobody."""
    d = driver("sim.gpus=6", "sim.instance_gpus=2")
    costs, model, tp = d.spec.costs, d.spec.policy, d.spec.tp
    shifted(d, Role.TRAIN, 0, 1, 2)

    def step(devices: tuple[int, ...], version: int) -> float:
        d.submit(Step(devices, version, 10))
        return next(e for e in d.next_events() if isinstance(e, Trained)).seconds

    update = costs.optimizer_step(model, 2 * tp)
    assert step((0, 1), 0) == pytest.approx(update + costs.regroup(model, 2 * tp))
    assert costs.regroup(model, 2 * tp) > 0
    assert step((0, 1), 1) == pytest.approx(update)
    d.submit(Shift(2, Role.TRAIN, 2))  # the third device takes the current version
    assert any(isinstance(e, ShiftDone) for e in d.next_events())
    assert step((0, 1, 2), 2) == pytest.approx(costs.optimizer_step(model, 3 * tp) + costs.regroup(model, 3 * tp))


def test_a_lockstep_trainer_buffers_groups_and_backpropagates_them_at_the_step():
    """train.backend=fsdp: a group handed to a train instance is only buffered there (no tokens reported, as the
    runtime's FSDP2 worker does); the step backpropagates every buffered token, dealt evenly over its instances,
    then updates, and reports that backward in ``Trained``."""
    d = driver("sim.gpus=4", "sim.instance_gpus=2", "train.backend=fsdp")
    assert d.spec.lockstep_train and not driver("train.backend=zero").spec.lockstep_train
    shifted(d, Role.TRAIN, 0, 1)
    shard = TrainShard(((1,) * 10, (1,) * 10), ((2,) * 20, (2,) * 20), ((0.0,) * 20, (0.0,) * 20), (1.0, -1.0))
    d.submit(Accumulate(0, 0, shard))
    assert d.next_events() == [Accumulated(0, 2, 0, 0.0)]
    d.submit(Step((0, 1), 0, 40))
    trained = next(e for e in d.next_events() if isinstance(e, Trained))
    costs, model, tp = d.spec.costs, d.spec.policy, d.spec.tp
    backward = costs.train_tokens(model, 30, tp, 30)  # 60 tokens over 2 instances
    assert (trained.backward_tokens, trained.backward_seconds) == (60, pytest.approx(backward))
    update = costs.optimizer_step(model, 2 * tp) + costs.regroup(model, 2 * tp)
    assert trained.seconds == pytest.approx(backward + update)
