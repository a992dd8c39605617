"""The ideal step: each piece of work priced as the formula says, and no simulated mode above it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from pivotrl.config import load_config
from pivotrl.control.messages import Role
from pivotrl.sim.driver import SimSpec
from pivotrl.sim.ideal import (
    IdealStep,
    ideal_for_job,
    ideal_step,
    ideals_by_size,
    joint_floor,
    length_moments,
    spread_ends,
)
from pivotrl.sim.models import MODELS
from pivotrl.sim.run import run_simulation
from pivotrl.sim.workload import LengthDist
from tests.sim.test_measured import PROFILE
from tests.sim.test_run import EXAMPLE, SMALL


class LinearCosts:
    """Round numbers: a decode step 0.1 s + 1 ms per sequence, 1 ms per prefill token, 0.1 ms per trained
    token, an optimizer step of 2 GPU-seconds, 10 sequences per instance."""

    def __init__(self) -> None:
        self.contexts: list[float] = []

    def decode_step(self, model, tp, batch, mean_context):
        self.contexts.append(mean_context)
        return 0.1 + 0.001 * batch

    def decode_span(self, model, tp, batch, context, steps):
        return steps * (0.1 + 0.001 * batch)

    def prefill(self, model, tp, tokens, seq_len=None):
        return 0.001 * tokens

    def max_batch(self, model, tp, context_len):
        return 10

    def kv_tokens(self, model, tp):  # (a paged cache: ample)
        return 10**6

    def train_tokens(self, model, tokens, n_gpus, seq_len=0):
        return 1e-4 * tokens / n_gpus

    def optimizer_step(self, model, n_gpus):
        return 2.0 / n_gpus

    def regroup(self, model, n_gpus):
        return 0.0


def spec(costs: LinearCosts, lengths: LengthDist) -> SimSpec:
    qwen = MODELS["Qwen2.5-7B"]
    return SimSpec(devices=4, tp=2, costs=costs, policy=qwen, genrm=qwen, lengths=lengths, seed=0, prompt_len=5,
                   max_batch=8, rollout_context=100, judge_context=200, judge_template_len=3,
                   judge_lengths=LengthDist.fixed(4), yes_probability=0.5, verdicts=("no", "yes"))  # fmt: skip


def test_a_hand_computed_step():
    costs = LinearCosts()
    # 16 responses of 11 tokens on 4 instances of 2 GPUs, batches of 8 (rollout.max_batch < the 10 memory allows)
    step = ideal_step(spec(costs, LengthDist.fixed(11)), samples=16, rollout_tokens=100, judge_tokens=100)
    decode = 2 * (0.1 + 0.001 * 8) / 8  # GPU-seconds of one token decoded in a batch of 8 on 2 GPUs
    expected = {
        "rollout_prefill": 2 * 16 * 0.001 * 5,  # 5-token prompts
        "rollout_decode": 16 * 10 * decode,  # the first of 11 tokens comes from the prefill
        "judge_prefill": 2 * 16 * 0.001 * (5 + 11 + 3),  # prompt + response + template
        "judge_decode": 16 * 3 * decode,  # 4-token judgments
        "train": 1e-4 * 16 * (5 + 11),
        "optimizer": 2.0,
    }
    assert step.gpu_seconds == pytest.approx(expected)
    assert step.gpus == 8 and step.rollout_batch == step.judge_batch == 8
    assert step.samples_per_s == pytest.approx(16 / (sum(expected.values()) / 8))
    # contexts: a response decodes at 6..15 (mean 10.5), a judgment at 20..22 (mean 21)
    assert costs.contexts == pytest.approx([10.5, 21.0])
    assert step.by_role["rollout"] == pytest.approx(expected["rollout_prefill"] + expected["rollout_decode"])
    # the longest response alone: its prefill, 10 decode steps at batch 1, its judge prefill, 3 judge steps
    assert step.critical_path_s == pytest.approx(0.005 + 10 * 0.101 + 0.019 + 3 * 0.101)


def test_a_paged_judge_reads_a_groups_beginning_once():
    """Judge prompts of 19 tokens begin with the 8 of the template and the question, alike in a group: with a
    paged cache (a prefix cache) a group of 4 reads them once, the other 3 only their responses, and the
    critical path's judgment finds its group's beginning cached."""
    costs = LinearCosts()
    base = spec(costs, LengthDist.fixed(11))
    plain = ideal_step(base, samples=16, rollout_tokens=100, judge_tokens=100, group_size=4)
    assert plain.gpu_seconds["judge_prefill"] == pytest.approx(2 * 16 * 0.001 * 19)  # no cache kept
    paged = ideal_step(dataclasses.replace(base, paged=True), 16, 100, 100, group_size=4)
    assert paged.gpu_seconds["judge_prefill"] == pytest.approx(2 * 16 * 0.001 * (19 - 8 * 3 / 4))
    assert paged.critical_path_s == pytest.approx(plain.critical_path_s - 0.001 * 8)
    alone = ideal_step(dataclasses.replace(base, paged=True), 16, 100, 100, group_size=1)
    assert alone.gpu_seconds["judge_prefill"] == pytest.approx(2 * 16 * 0.001 * 19)  # groups of one share nothing


def test_judgments_of_spread_lengths_are_priced_at_their_mean():
    """A reasoning judge (judgments of 1..7 tokens, mean 4): E[O - 1] = 3 decode steps a judgment, at the
    token-weighted mean context J + E[O (O - 1) / 2] / E[O - 1] = 19 + 8 / 3. On the critical path the
    16 responses end together and the longest of their 16 judgments (7 tokens) follows."""
    costs = LinearCosts()
    base = spec(costs, LengthDist.fixed(11))
    step = ideal_step(dataclasses.replace(base, judge_lengths=LengthDist.uniform(1, 7)), 16, 100, 100)
    assert step.gpu_seconds["judge_decode"] == pytest.approx(16 * 3 * 2 * (0.1 + 0.001 * 8) / 8)
    assert costs.contexts == pytest.approx([10.5, 19 + 8 / 3], rel=1e-4)  # (a grid of quantiles)
    assert step.critical_path_s == pytest.approx(0.005 + 10 * 0.101 + 0.019 + 6 * 0.101)
    capped = ideal_step(dataclasses.replace(base, judge_lengths=LengthDist.uniform(1, 7)), 16, 100, judge_tokens=2)
    # capped at 2 tokens: E[min(O, 2) - 1] = 6 / 7 decode steps a judgment
    assert capped.gpu_seconds["judge_decode"] == pytest.approx(16 * 6 / 7 * 2 * (0.1 + 0.001 * 8) / 8, rel=1e-3)


def test_a_shorter_response_judged_at_length_can_end_the_path():
    """Responses of 1..16 tokens, judgments of 1..64: the longest response (1 of 16) is judged in a
    judgment of its own draw, at most the 1 - 1/2 quantile (33 tokens), while the 8 longest responses
    (9..16 tokens) hold a judgment of about 61 (the 1 - 1/16 quantile): the path ends with those."""
    costs = LinearCosts()
    base = spec(costs, LengthDist.uniform(1, 16))
    step = ideal_step(dataclasses.replace(base, judge_lengths=LengthDist.uniform(1, 64)), 16, 100, 100)
    ends = {length: (k, at) for length, k, at in spread_ends(base, 16, 100)}
    assert ends[16][0] == 1 and ends[9][0] == 8

    def path(length: int, out: int) -> float:
        return ends[length][1] + 0.001 * (5 + length + 3) + (out - 1) * 0.101

    update = 1e-4 * (5 + 16) / 2 + 2.0 / 8
    assert path(9, 61) > path(16, 33)
    assert step.spread_path_s >= path(9, 61) + update - 1e-9
    assert step.spread_path_s == pytest.approx(max(path(x, LengthDist.uniform(1, 64).quantile(1 - 1 / (2 * k)))
                                                   for x, (k, _) in ends.items()) + update)  # fmt: skip


def test_the_spread_path_by_hand():
    costs = LinearCosts()
    # 16 responses of 1..16 tokens (one of each on the grid) on 4 instances: at decode step x, 16 - x still run
    step = ideal_step(spec(costs, LengthDist.uniform(1, 16)), samples=16, rollout_tokens=100, judge_tokens=100)
    batches = [-(-(16 - x) // 4) for x in range(1, 16)]
    assert batches == [4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    rollout = 0.001 * 4 * 5 + sum(0.1 + 0.001 * b for b in batches)  # 4 prompts of 5 prefilled together
    judged = 0.001 * (5 + 16 + 3) + 3 * 0.101  # the longest judged alone
    # its backward on one instance of 2 GPUs, then the optimizer step on the group that makes it shortest
    # (every GPU, as LinearCosts' step shrinks with the group)
    update = 1e-4 * (5 + 16) / 2 + 2.0 / 8
    assert step.spread_path_s == pytest.approx(rollout + judged + update)
    assert step.spread_rollout_s == pytest.approx(rollout)
    assert step.critical_path_s == pytest.approx(0.005 + 15 * 0.101 + judged)
    assert step.floor_seconds == max(step.step_seconds, step.spread_path_s, step.joint_floor_s, step.group_path_s)


def test_the_group_path_by_hand():
    # the same 16 responses in 4 groups of 4: a group trains once all of its responses are judged. For
    # every length x, the groups holding one of the k responses at least x long (4 (1 - C(16 - k, 4) /
    # C(16, 4)) of them) start training no sooner than x ends on the spread path and the first of those
    # is judged; then all of their backward, on all 8 GPUs, and the optimizer step
    costs = LinearCosts()
    lengths = LengthDist.uniform(1, 16)
    step = ideal_step(spec(costs, lengths), samples=16, rollout_tokens=100, judge_tokens=100, group_size=4)
    mean, _ = length_moments(lengths, 100)

    def path(x: int, k: int, at: float) -> float:
        groups = 4 * (1 - math.comb(16 - k, 4) / math.comb(16, 4))
        backward = 1e-4 * groups * (4 * 5 + 3 * mean + x) / 8
        return at + 0.001 * (5 + x + 3) + 3 * 0.101 + backward + 2.0 / 8

    ends = spread_ends(spec(costs, lengths), 16, 100)
    assert step.group_path_s == pytest.approx(max(path(x, k, at) for x, k, at in ends), rel=1e-5)  # whole tokens
    # the longest response's group alone: one group of the four
    assert step.group_path_s >= path(16, 1, ends[-1][2]) - 1e-12
    assert step.floor_seconds >= step.group_path_s
    # one response a group: each trains on its own once judged, a floor no higher
    alone = ideal_step(spec(costs, lengths), samples=16, rollout_tokens=100, judge_tokens=100)
    assert alone.group_path_s < step.group_path_s


def test_the_joint_floor_waits_for_the_last_groups_to_train():
    # responses of one length end together: every group is whole at the last token, so after it come
    # the judgments and the backward of all 16 groups, on every GPU, where the joint floor used to
    # count one response's backward
    costs = LinearCosts()
    costs.train_tokens = lambda model, tokens, n_gpus, seq_len=0: 0.01 * tokens / n_gpus  # training weighs
    step = ideal_step(spec(costs, LengthDist.fixed(11)), samples=64, rollout_tokens=100, judge_tokens=100,
                      group_size=4)  # fmt: skip
    assert step.joint_floor_s >= step.group_path_s - 1e-9
    backward = 0.01 * 64 * (5 + 11) / 8
    assert step.group_path_s == pytest.approx(step.spread_rollout_s + 0.001 * 19 + 3 * 0.101 + backward + 2.0 / 8)


def test_a_trainer_that_backpropagates_at_the_step_has_a_floor_of_its_own():
    # every response of one length ends at the last token; a lockstep trainer (FSDP2) then judges the last
    # alone and backpropagates every group after it, on every GPU, before the update
    costs = LinearCosts()
    costs.train_tokens = lambda model, tokens, n_gpus, seq_len=0: 0.01 * tokens / n_gpus  # training weighs
    sim = spec(costs, LengthDist.fixed(11))
    free = ideal_step(sim, samples=64, rollout_tokens=100, judge_tokens=100, group_size=4)
    held = ideal_step(dataclasses.replace(sim, lockstep_train=True), samples=64, rollout_tokens=100, judge_tokens=100,
                      group_size=4)  # fmt: skip
    assert free.lockstep_floor_s == 0.0 and free.to_dict()["lockstep_floor_s"] == 0.0
    judged = 0.001 * (5 + 11 + 3) + 3 * 0.101  # the last response's judge prefill, then 3 judge steps alone
    backward = 0.01 * 64 * (5 + 11) / 8  # every group's, on all 8 GPUs
    assert held.lockstep_floor_s >= held.spread_rollout_s + judged + backward + 2.0 / 8 - 1e-9
    # here every group is whole at the last token, so the joint floor trains them all after it too
    assert held.lockstep_floor_s == pytest.approx(held.joint_floor_s)
    # lengths that spread: the joint floor trains the groups whole early before the last token, the trainer cannot
    # (few enough responses that the tail, not the work, sets the step)
    sim = spec(costs, LengthDist.lognormal(20, 0.8, 90))
    free = ideal_step(sim, 64, rollout_tokens=90, judge_tokens=100, group_size=4)
    held = ideal_step(dataclasses.replace(sim, lockstep_train=True), 64, rollout_tokens=90, judge_tokens=100,
                      group_size=4)  # fmt: skip
    assert held.lockstep_floor_s > held.joint_floor_s * 1.1
    # the rest of the ideal is not the trainer's: the same joint floor either way
    assert held.joint_floor_s == pytest.approx(free.joint_floor_s)
    assert held.floor_seconds == pytest.approx(free.floor_seconds)


@pytest.mark.parametrize("group_size", [0, 17, 2.0, True])
def test_a_group_size_outside_the_step_is_refused(group_size):
    with pytest.raises(ValueError, match="group_size"):
        ideal_step(spec(LinearCosts(), LengthDist.fixed(11)), 16, 100, 100, group_size=group_size)


def primal(costs: LinearCosts, lengths: list[int], instances: int, tp: int, rest: float, after: float) -> float:
    """The joint floor's own problem by brute force: every choice of instances at every decode step."""
    alive = [sum(1 for n in lengths if n > x) for x in range(1, max(lengths))]
    gpus, best = instances * tp, math.inf
    prefill = 0.001 * 5 * -(-len(lengths) // instances)
    for ds in itertools.product(*[range(-(-a // 8), instances + 1) for a in alive]):
        times = [0.1 + 0.001 * -(-a // d) for a, d in zip(alive, ds, strict=True)]
        work = tp * sum(d * t for d, t in zip(ds, times, strict=True))
        best = min(best, max(prefill + sum(times) + after, (work + rest) / gpus))
    return best


@pytest.mark.parametrize("samples", [6, 8])
def test_the_joint_floor_is_below_every_schedule_and_above_both_ends(samples):
    costs = LinearCosts()
    step = ideal_step(spec(costs, LengthDist.uniform(1, samples)), samples, rollout_tokens=100, judge_tokens=100)
    rest = step.total - step.gpu_seconds["rollout_decode"]
    after = step.spread_path_s - step.spread_rollout_s
    brute = primal(costs, list(range(1, samples + 1)), instances=4, tp=2, rest=rest, after=after)
    # the dual of the brute-force minimum: never above it, and here (a convex-enough problem) close to it
    assert step.joint_floor_s <= brute + 1e-9
    assert step.joint_floor_s >= 0.97 * brute
    # lam = 1 is the spread path; lam = 0 the work alone, the tail packed into full batches
    assert step.joint_floor_s >= step.spread_path_s - 1e-9
    packed = 2 * sum(0.1 + 0.001 * a for a in range(1, samples))  # one instance holds every alive response
    assert step.joint_floor_s >= (packed + rest) / 8 - 1e-9


def test_the_joint_floors_rollout_run_by_run_adds_up_to_what_it_prices():
    """``JointFloor.runs`` is the rollout the floor prices, as a schedule to replay: its runs follow each other
    from the first decode step to the longest response's, each on as many instances as the floor keeps."""
    costs = LinearCosts()
    sim = spec(costs, LengthDist.lognormal(20, 0.6, 90))
    step = ideal_step(sim, 128, rollout_tokens=90, judge_tokens=100)
    rest = step.total - step.gpu_seconds["rollout_decode"]
    jf = joint_floor(sim, 128, 90, rest, step.after_s)
    assert jf == step.joint  # (the step keeps the one it priced)
    assert jf.runs[0][0] == 1 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(jf.runs))
    longest = max(min(sim.lengths.quantile((i + 0.5) / 128), 90) for i in range(128))
    assert jf.runs[-1][0] + jf.runs[-1][1] == longest
    assert jf.rollout_s == pytest.approx(jf.prefill_s + sum(s for _, _, s, _ in jf.runs))
    # a run holding more responses than every instance's batch is priced at each one's share of full batches,
    # more than its instances' time: all of them run it
    assert all(1 <= k <= sim.devices for _, _, _, k in jf.runs)
    assert sum(sim.tp * k * s for _, _, s, k in jf.runs) <= jf.rollout_gpu_s + 1e-9
    assert [k for *_, k in jf.runs] != [sim.devices] * len(jf.runs)  # the tail packed into fewer somewhere
    # fewer responses than the instances hold at once: the instances' time is the GPU-seconds it prices
    few = ideal_step(sim, 32, rollout_tokens=90, judge_tokens=100)
    jf = joint_floor(sim, 32, 90, few.total - few.gpu_seconds["rollout_decode"], few.after_s)
    assert jf.rollout_gpu_s == pytest.approx(sum(sim.tp * k * s for _, _, s, k in jf.runs))


def test_the_joint_floor_binds_where_a_long_tail_meets_much_work():
    # the step's work and its spread path about equal: neither floor alone sees that the tail either
    # keeps every instance (the other work waits) or packs into few (the tail slows)
    costs = LinearCosts()
    step = ideal_step(spec(costs, LengthDist.lognormal(20, 0.6, 90)), 128, rollout_tokens=90, judge_tokens=100)
    assert step.joint_floor_s > max(step.step_seconds, step.spread_path_s) * 1.05
    # the rollout it prices there: no faster than the spread path's, no cheaper than full batches, and a
    # schedule with it takes at least the floor (a choice at the dual's peak meets both of its sides)
    assert step.spread_rollout_s - 1e-9 <= step.joint_rollout_s
    assert step.gpu_seconds["rollout_decode"] - 1e-9 <= step.joint_rollout_gpu_s
    rest = step.total - step.gpu_seconds["rollout_decode"]
    primal = max(step.joint_rollout_s + step.after_s, (step.joint_rollout_gpu_s + rest) / step.gpus)
    assert step.joint_floor_s <= primal + 1e-9
    assert primal <= 1.1 * step.joint_floor_s


@pytest.mark.parametrize(("samples", "batch"), [(2, 1), (16, 4), (64, 8)])  # 4 instances; 8 at most to one
def test_equal_lengths_decode_side_by_side_to_the_end(samples, batch):
    costs = LinearCosts()
    step = ideal_step(spec(costs, LengthDist.fixed(11)), samples=samples, rollout_tokens=100, judge_tokens=100)
    rollout = 0.001 * batch * 5 + 10 * (0.1 + 0.001 * batch)
    judged = 0.001 * (5 + 11 + 3) + 3 * 0.101
    assert step.spread_path_s == pytest.approx(rollout + judged + 1e-4 * 16 / 2 + 2.0 / 8)


def test_judgments_and_responses_are_capped():
    costs = LinearCosts()
    step = ideal_step(spec(costs, LengthDist.fixed(11)), samples=16, rollout_tokens=6, judge_tokens=2)
    decode = 2 * (0.1 + 0.001 * 8) / 8
    assert step.mean_response == 6
    assert step.gpu_seconds["rollout_decode"] == pytest.approx(16 * 5 * decode)
    assert step.gpu_seconds["judge_decode"] == pytest.approx(16 * 1 * decode)


def test_length_moments_over_the_quantile_grid():
    # uniform 1..4 on a 4-point grid: each length once
    assert length_moments(LengthDist.uniform(1, 4), cap=100, grid=4) == (2.5, (0 + 1 + 3 + 6) / 4)
    assert length_moments(LengthDist.uniform(1, 4), cap=2, grid=4) == (1.75, (0 + 1 + 1 + 1) / 4)
    mean, _ = length_moments(LengthDist.lognormal(1200, 0.9, 8192), cap=8192)
    assert mean == pytest.approx(LengthDist.lognormal(1200, 0.9, 8192).mean(), rel=0.01)


@pytest.mark.parametrize(
    ("work", "devices", "split"),
    [
        ({"rollout": 2.0, "judge": 1.0, "train": 1.0}, 8, {"rollout": 4, "judge": 2, "train": 2}),
        ({"rollout": 98.0, "judge": 1.0, "train": 1.0}, 8, {"rollout": 6, "judge": 1, "train": 1}),  # one each
        ({"rollout": 1.0, "judge": 1.0, "train": 1.0}, 10, {"rollout": 4, "judge": 3, "train": 3}),
    ],
)
def test_split_in_proportion_to_work(work, devices, split):
    gpu_seconds = {"rollout_prefill": 0.0, "rollout_decode": work["rollout"], "judge_prefill": 0.0,
                   "judge_decode": work["judge"], "train": work["train"], "optimizer": 0.0}  # fmt: skip
    assert IdealStep(16, 8, 8, 8, 11.0, gpu_seconds).split(devices) == split


def test_an_instance_without_room_is_refused():
    costs = LinearCosts()
    costs.max_batch = lambda model, tp, context_len: 0
    with pytest.raises(ValueError, match="holds no sequence"):
        ideal_step(spec(costs, LengthDist.fixed(11)), 16, 100, 100)
    assert spec(LinearCosts(), LengthDist.fixed(11)).capacity(Role.JUDGE) == 8


# responses of one length end together, and the longest of their 32 spread judgments (most steps hold one
# at the 1,024-token cap) follows them: the judged path binds (11.2 s a step against 4.7 s with
# judgments of one length), and no mode may beat it
REASONING = ("sim.judge_output_sigma=1.5", "judge.max_new_tokens=1024",
             "sim.lengths.kind=fixed", "sim.lengths.value=200")  # fmt: skip


@pytest.mark.parametrize("extra", [(), REASONING], ids=["fixed judgments", "reasoning judge"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "shiftable"])
def test_no_simulated_mode_beats_the_ideal(tmp_path, mode, extra):
    cfg = load_config(EXAMPLE, [*SMALL, f"mode={mode}", "steps=3", *extra])
    summary = run_simulation(cfg, tmp_path)
    ideal = ideal_for_job(cfg)
    assert 0 < summary["steady_samples_per_s"] < ideal.samples / ideal.floor_seconds <= ideal.samples_per_s


def test_imports_neither_torch_nor_ray_nor_numpy():
    from tests.control.test_purity import probe

    proc = probe("pivotrl.sim.ideal")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_ideal_at_each_instance_size_is_the_jobs_at_that_size():
    """The bundled 128-GPU job: every size holds the 7B models, each ideal is the job's own at that size (its
    mode and split aside), and the floor is lowest on 4 GPUs though 1 has the highest ideal throughput. No
    instance of 8 GPUs serves a 7B model: its 28 attention heads cannot be cut in 8."""
    job = load_config(EXAMPLE, ["mode=disaggregated", "split=rollout:100,judge:14,train:14"])
    found = ideals_by_size(job)
    assert sorted(found) == [1, 2, 4]
    for tp, step in found.items():
        alone = ideal_for_job(load_config(EXAMPLE, [f"sim.instance_gpus={tp}"]))
        assert step.floor_seconds == pytest.approx(alone.floor_seconds) and step.gpus == 128
        assert step.floor_samples_per_s == pytest.approx(step.samples / step.floor_seconds)
    assert max(found, key=lambda tp: found[tp].floor_samples_per_s) == 4
    assert max(found, key=lambda tp: found[tp].samples_per_s) == 1
    assert sorted(ideals_by_size(job, (2, 3, 4))) == [2, 4]  # 128 GPUs do not split into instances of 3


def test_no_other_instance_size_where_the_judge_fits_only_on_8_or_costs_are_measured(tmp_path):
    big = load_config(EXAMPLE, ["sim.judge_model=Qwen3-235B-A22B", "sim.policy_model=Qwen2.5-14B",
                                "sim.instance_gpus=8"])  # fmt: skip
    assert list(ideals_by_size(big)) == [8]
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(PROFILE))
    measured = [*SMALL, f"sim.costs={costs}", "rollout.max_new_tokens=64", "eval.max_new_tokens=64",
                "judge.max_new_tokens=64", "sim.prompt_len=64", "rollout.max_batch=32"]  # fmt: skip
    assert ideals_by_size(load_config(EXAMPLE, measured)) == {}
