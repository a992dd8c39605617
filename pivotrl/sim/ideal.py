"""The ideal throughput of a simulated job: all the work of a step divided by all the capacity.

A mode's throughput is only good or bad next to what the cluster could do at
all. The ideal prices every piece of a step's work with the job's own cost
model and workload, at the most efficient batch the memory allows, and spreads
it over every GPU with no idle time and no shift cost:

    GPU-seconds of a step  W = W_rollout + W_judge + W_train
    ideal samples/s           = N / (W / G)          N samples per step, G GPUs

with, for N responses of length L (drawn from the job's capped distribution),
prompts of P tokens, judge prompts of J = P + L + T tokens and judgments of O
tokens (``sim.judge_output_len``, lognormal about it with
``sim.judge_output_sigma``, capped at ``judge.max_new_tokens``), on
instances of ``tp`` GPUs holding at most B (policy) and Bj (judge) sequences
(``SimSpec.capacity``: ``rollout.max_batch`` or fewer if the KV cache says so; a
paged cache is counted at the role's mean decode context). The judge prompts of
a group of G responses begin with the same S = P + T tokens (the template and
the question come before the response): a paged cache, a prefix cache, reads
them once a group (S = 0 without one; their attention is priced at the whole
prompt, which only lowers it):

    W_rollout = tp * N * [prefill(B prompts of P) / B + E[L - 1] * decode_step(B, c) / B]
    W_judge   = tp * N * [prefill(Bj prompts of E[J] - S (G - 1) / G) / Bj + E[O - 1] * decode_step(Bj, cj) / Bj]
    W_train   = train_tokens(N * (P + E[L]) tokens on 1 GPU, sequences of P + E[L])
                + tp * optimizer_step(tp GPUs)

The first token of a response comes from its prefill, as in the modeled
engine, so a response decodes L - 1 steps at contexts P + 1 .. P + L - 1; the
decode step is priced at the token-weighted mean context
c = P + E[L (L - 1) / 2] / E[L - 1] (cj = E[J] + E[O (O - 1) / 2] / E[O - 1]
for the judge). E is taken over a grid of quantiles of the length distribution, the same
inverse-transform draws the simulator makes. Left out, as no mode can avoid
them less than this: idle time (the tail of a step waiting for its longest
response, roles waiting for each other), shifts and weight refreshes,
migrations' re-prefill, the gradient sync of a data-parallel group (the
optimizer step is priced on one instance), and prefills in smaller batches
than B. So no mode beats it, and each mode's share of it says how much of the
cluster it wastes.

The ideal also ignores latency. A step of on-policy RL cannot end before its
longest response is generated and judged, one token after the other, so its
``critical_path_s`` (the longest of N responses, the ``1 - 1/2N`` quantile,
decoded at batch 1, then judged at batch 1) is a floor under any mode's step
time; where it exceeds the ideal step time, no synchronous schedule reaches
the ideal. Where judgments spread in length too (a judge that reasons), a
shorter response may end later judged: for every length x the k = N P(L >= x)
responses at least x long end no earlier than the x-th token, and the longest
of their k judgments (the ``1 - 1/2k`` quantile of the judgment lengths)
follows, so the path is the largest such sum over x. With judgments of one
length it is the longest response's.

Batch 1 is a floor no engine reaches: the longest response decodes beside the
others of its step. ``spread_path_s`` prices that. The N responses start
together (a response's length is not known while it runs, so the one that
will be longest cannot be told apart from the others of its age); at each
decode step x the ones still generating, N P(L > x) on the same quantile grid
as above, are spread evenly over every instance (at most B to one), which is
the spread that keeps the longest response's expected batch smallest when a
step's time grows linearly with its batch. So the longest response takes

    prefill(min(B, N / D) prompts)
      + sum over x = 1 .. L_max - 1 of decode_step(min(B, max(1, ceil(alive(x) / D))), P + x)

on D instances (and a response of length x its first x tokens), then it is
judged alone as above (the largest sum over x), its group's backward runs on
one instance (its own sample, the longest), and the optimizer step follows,
on as many instances as make it shortest: what must happen after the last
token before the next step's policy exists. Any schedule that moves
instances out of the rollout while it runs only makes the batches larger; the ratio of a mode's
step time to ``max(ideal step, spread_path_s)`` is the most any schedule
could gain over it.

The two floors each leave out what the other prices: the ideal packs the
rollout into full batches, the spread path spreads its tail over every
instance, and a schedule cannot do both at once. The joint floor chooses, at
each decode step x of the same lock-step rollout, how many instances d_x carry
the alive(x) responses still running (batches of ceil(alive / d_x), at most
B): fewer instances leave GPUs free for the judge and the trainer but make
each decode step slower. A step of any such schedule lasts at least

    R(d) + after        R(d) = prefill + sum over x of decode_step(ceil(alive(x) / d_x), P + x)
    (W_rollout(d) + W_rest) / G        W_rollout(d) = tp * sum over x of d_x * decode_step(...)

with ``after`` what follows the last token (below) and W_rest every other
piece of the ideal's work at its ideal price. The floor is the largest value
over lam in [0, 1] of the minimum over d of
lam (R(d) + after) + (1 - lam) (W_rollout(d) + W_rest) / G,
the Lagrangian dual of minimising the larger of the two: the minimum
separates per decode step, and runs of steps whose alive count stays within
2% are priced at their fewest responses, which only lowers it. lam = 1 is the
spread path, lam = 0 the work alone with the tail packed; any schedule's step
is at least the dual's value at every lam.

A group trains once all G of its responses are judged (its advantages need
every reward), and the groups that hold the step's longest responses are many:
with N = 8,192 responses in groups of 16, the 135 that run to the cap sit in
about 120 of the 512 groups. ``group_path_s`` prices that: for every length x,
the expected M (1 - C(N - k, G) / C(N, G)) groups (M prompts) that hold one of
the k responses at least x long cannot train before x ends on the spread path
and the first of those k is judged; then all of their backward runs, on every
GPU, and the optimizer step follows. Each such group holds G prompts, its long
response (at least x) and G - 1 others of at least the mean length (knowing
one is long does not shorten the rest). The joint floor's ``after`` is the
larger of the spread path's (the last response judged, its backward) and this
path's from the last token on: the responses that run longest end together
there, and the groups that hold them all train after.

A trainer that backpropagates every group at the step (FSDP2, ``lockstep_train``:
under FSDP every forward and backward is a collective of the whole train
group, so it buffers the step's groups and runs them after the last
judgment) adds a floor of its own, ``lockstep_floor_s``: the joint floor with
``after`` at least the last response judged alone, then every group's
backward on every GPU, then the update. It bounds every schedule of that
trainer, not every schedule: a trainer that backpropagates each group once
judged is held only by the joint floor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pivotrl.config import JobConfig
from pivotrl.control.messages import Role
from pivotrl.errors import UserError
from pivotrl.sim.costs import span_of
from pivotrl.sim.driver import SimSpec
from pivotrl.sim.run import build
from pivotrl.sim.workload import GRID, decode_context, length_moments, quantiles

MERGE = 0.98  # the joint floor prices runs of decode steps whose alive count stays within 2% as one
GOLDEN = (5**0.5 - 1) / 2


@dataclass(frozen=True, slots=True)
class IdealStep:
    """The GPU-seconds of one step's work, by piece, and what they allow on ``gpus`` GPUs."""

    samples: int  # responses per step
    gpus: int
    rollout_batch: int  # B: the batch decode is priced at
    judge_batch: int  # Bj
    mean_response: float  # E[L], tokens
    gpu_seconds: dict[str, float]  # rollout_prefill, rollout_decode, judge_prefill, judge_decode, train, optimizer
    critical_path_s: float = 0.0  # the longest response generated and judged alone
    spread_path_s: float = 0.0  # ... generated beside its even share of the others, judged, trained, and the update
    spread_rollout_s: float = 0.0  # of which its generation
    joint_floor_s: float = 0.0  # the step time no schedule beats, the rollout's tail and all the work together
    group_path_s: float = 0.0  # the groups holding the longest responses judged, then trained on every GPU
    after_s: float = 0.0  # what the joint floor counts after the last token: its judgment, backward, the update
    joint_rollout_s: float = 0.0  # the rollout the joint floor prices: its generation (a floor for it, no more) ...
    joint_rollout_gpu_s: float = 0.0  # ... and its decode's GPU-seconds, in the smaller batches of its tail
    joint: JointFloor | None = None  # the joint floor as priced, its rollout run by run (not in ``to_dict``)
    optimizer_s: float = 0.0  # the update's optimizer step, on the group of instances that makes it shortest
    lockstep_floor_s: float = 0.0  # a trainer that backpropagates at the step: no schedule of it beats this (0: none)

    @property
    def total(self) -> float:
        return sum(self.gpu_seconds.values())

    @property
    def by_role(self) -> dict[str, float]:
        g = self.gpu_seconds
        return {
            Role.ROLLOUT.value: g["rollout_prefill"] + g["rollout_decode"],
            Role.JUDGE.value: g["judge_prefill"] + g["judge_decode"],
            Role.TRAIN.value: g["train"] + g["optimizer"],
        }

    @property
    def step_seconds(self) -> float:
        return self.total / self.gpus

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_seconds

    @property
    def floor_seconds(self) -> float:
        """The shortest a step can be: the longest of the ideal step and the three paths."""
        return max(self.step_seconds, self.spread_path_s, self.joint_floor_s, self.group_path_s)

    @property
    def floor_samples_per_s(self) -> float:
        """Samples/s if every step took its floor: no schedule does better."""
        return self.samples / self.floor_seconds

    def split(self, devices: int) -> dict[str, int]:
        """``devices`` divided between the roles in proportion to their work, at least one each: the
        static split that would be best if every role were busy all the time."""
        share = {r: w / self.total for r, w in self.by_role.items()}
        out = {r: max(1, round(s * devices)) for r, s in share.items()}
        largest = max(out, key=lambda r: out[r])
        out[largest] += devices - sum(out.values())
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "samples_per_s": self.samples_per_s,
            "step_seconds": self.step_seconds,
            "gpu_seconds": dict(self.gpu_seconds),
            "gpu_seconds_by_role": self.by_role,
            "rollout_batch": self.rollout_batch,
            "judge_batch": self.judge_batch,
            "mean_response": self.mean_response,
            "critical_path_s": self.critical_path_s,
            "spread_path_s": self.spread_path_s,
            "spread_rollout_s": self.spread_rollout_s,
            "joint_floor_s": self.joint_floor_s,
            "group_path_s": self.group_path_s,
            "after_s": self.after_s,
            "joint_rollout_s": self.joint_rollout_s,
            "joint_rollout_gpu_s": self.joint_rollout_gpu_s,
            "floor_seconds": self.floor_seconds,
            "lockstep_floor_s": self.lockstep_floor_s,
        }


def ideal_step(
    spec: SimSpec, samples: int, rollout_tokens: int, judge_tokens: int, grid: int = GRID, group_size: int = 1
) -> IdealStep:
    """The ideal step of ``samples`` responses on ``spec``'s cluster; ``rollout_tokens`` and
    ``judge_tokens`` are the jobs' generation caps (``rollout.max_new_tokens``, ``judge.max_new_tokens``),
    ``group_size`` the responses of a prompt (``rollout.group_size``: a group trains once all are judged)."""
    if samples < 1:
        raise ValueError(f"samples: got {samples!r}, must be >= 1")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= samples:
        raise ValueError(f"group_size: got {group_size!r}, must be an int in [1, samples={samples}]")
    costs, tp, p = spec.costs, spec.tp, spec.prompt_len
    rc, jc = spec.role_costs(Role.ROLLOUT), spec.role_costs(Role.JUDGE)  # an instance's, over its engines
    b, bj = spec.capacity(Role.ROLLOUT), spec.capacity(Role.JUDGE)
    if b < 1 or bj < 1:
        raise ValueError(f"an instance of {tp} GPU(s) holds no sequence (rollout {b}, judge {bj})")
    mean_len, _ = length_moments(spec.lengths, rollout_tokens, grid)
    decode_steps = mean_len - 1  # E[L - 1]: the first token comes from the prefill
    context = decode_context(p, spec.lengths, rollout_tokens, grid)
    judge_prompt = p + mean_len + spec.judge_template_len
    # a group's judgments begin alike: a paged cache reads that beginning once a group, the others' only their
    # responses (their attention still reaches back to it)
    shared = spec.judge_shared_len if group_size > 1 else 0
    judge_read = judge_prompt - shared * (group_size - 1) / group_size
    out_len, _ = length_moments(spec.judge_lengths, judge_tokens, grid)  # E[O]
    judge_context = decode_context(judge_prompt, spec.judge_lengths, judge_tokens, grid)
    n = samples
    gpu_seconds = {
        "rollout_prefill": tp * n * rc.prefill(spec.policy, tp, b * p, p) / b,
        "rollout_decode": tp * n * decode_steps * rc.decode_step(spec.policy, tp, b, context) / b,
        "judge_prefill": tp * n * jc.prefill(spec.genrm, tp, round(bj * judge_read), round(judge_prompt)) / bj,
        "judge_decode": tp * n * (out_len - 1) * jc.decode_step(spec.genrm, tp, bj, judge_context) / bj,
        "train": costs.train_tokens(spec.policy, round(n * (p + mean_len)), 1, round(p + mean_len)),
        "optimizer": tp * costs.optimizer_step(spec.policy, tp),
    }
    longest = min(spec.lengths.quantile(1 - 1 / (2 * n)), rollout_tokens)

    def judged_alone(length: int, company: int, first: bool = False) -> float:
        """A response of ``length`` judged alone, in the longest of ``company`` judgments (their 1 - 1/2k
        quantile: the one length they all have where they do not spread), or (``first``) the shortest."""
        judged = p + length + spec.judge_template_len
        out = spec.judge_lengths.quantile(1 / (2 * company) if first else 1 - 1 / (2 * company))
        decode = jc.decode_span(spec.genrm, tp, 1, judged + 1, max(0, min(out, judge_tokens) - 1))
        # (its group's beginning cached by another's judgment: its response read after it, attending to it)
        return jc.prefill(spec.genrm, tp, judged - shared, judged + shared) + decode

    # for every length x, the k responses at least x long end no earlier than x on the path and the
    # longest of their k judgments follows; with judgments of one length the longest response binds
    ends = spread_ends(spec, n, rollout_tokens)
    first = rc.prefill(spec.policy, tp, p, p)
    critical = max(first + rc.decode_span(spec.policy, tp, 1, p + 1, length - 1) + judged_alone(length, k)
                   for length, k, _ in ends)  # fmt: skip
    judged_path = max(at + judged_alone(length, k) for length, k, at in ends)
    rollout = ends[-1][2]
    # the optimizer step on the group that makes it shortest: one instance syncs nothing but moves the
    # whole optimizer state to and from the host, the whole cluster a sliver of it over the network
    optimizer = min(costs.optimizer_step(spec.policy, tp * k) for k in range(1, spec.devices + 1))
    update = costs.train_tokens(spec.policy, p + longest, tp, p + longest) + optimizer
    spread = judged_path + update
    gpus, prompts = spec.devices * tp, -(-n // group_size)

    def groups_trained(length: int, k: int) -> float:
        """From the first judgment of the k responses at least ``length`` long to the last backward of
        the groups holding them, all of those groups' backward on every GPU. A group holds one of them
        with the chance that its ``group_size`` draws from the ``n`` responses are not all from the
        others; its other responses are at least of the mean length (knowing that one is long does not
        shorten them), its long one at least ``length``; their attention priced at the mean sequence."""
        none = 1.0
        for i in range(group_size):
            none *= max(0.0, (n - k - i) / (n - i))
        tokens = prompts * (1 - none) * (group_size * p + (group_size - 1) * mean_len + length)
        return judged_alone(length, k, first=True) + costs.train_tokens(spec.policy, round(tokens), gpus,
                                                                       round(p + mean_len))  # fmt: skip

    group = max(at + groups_trained(length, k) for length, k, at in ends) + optimizer
    rest = sum(gpu_seconds.values()) - gpu_seconds["rollout_decode"]
    last, k_last, _ = ends[-1]
    after = max(judged_alone(last, k_last) + update - optimizer, groups_trained(last, k_last)) + optimizer
    joint = joint_floor(spec, n, rollout_tokens, rest, after)
    step = IdealStep(n, gpus, b, bj, mean_len, gpu_seconds, critical, spread, rollout, joint.seconds, group, after,
                     joint.rollout_s, joint.rollout_gpu_s, joint, optimizer)  # fmt: skip
    if not spec.lockstep_train:
        return step
    held = judged_alone(last, k_last) + gpu_seconds["train"] / gpus + optimizer  # every backward, on every GPU
    lockstep = joint_floor(spec, n, rollout_tokens, rest, max(after, held)).seconds
    return dataclasses.replace(step, lockstep_floor_s=max(step.floor_seconds, lockstep))  # (every schedule's holds)


def spread_rollout_s(spec: SimSpec, samples: int, rollout_tokens: int) -> float:
    """Seconds until the longest of ``samples`` responses is generated when they start together and those
    still running are spread evenly over every instance (the module docstring's ``spread_path_s``)."""
    return spread_ends(spec, samples, rollout_tokens)[-1][2]


def spread_ends(spec: SimSpec, samples: int, rollout_tokens: int) -> list[tuple[int, int, float]]:
    """On the spread path, for every length the responses reach (shortest first): the length, how many
    responses are at least that long, and when those of that length have ended."""
    costs, tp, p, d = spec.role_costs(Role.ROLLOUT), spec.tp, spec.prompt_len, spec.devices
    b = spec.capacity(Role.ROLLOUT)
    lengths = quantiles(spec.lengths, samples, rollout_tokens)
    seconds = costs.prefill(spec.policy, tp, min(b, -(-samples // d)) * p, p)
    x = 1  # the decode step at hand: the first token came from the prefill
    ends: list[tuple[int, int, float]] = []
    for i, length in enumerate(lengths):  # responses of this length end after step length - 1
        if length > x:
            alive = samples - i  # this response and every longer one
            batch = min(b, max(1, -(-alive // d)))
            seconds += costs.decode_span(spec.policy, tp, batch, p + x, length - x)
            x = length
        if not ends or ends[-1][0] != length:
            ends.append((length, samples - i, seconds))
    return ends


def ideal_for_job(cfg: JobConfig) -> IdealStep:
    """The ideal step of a ``pivotrl simulate`` job, from the spec the simulator builds for it (quietly: what a
    run of the job would meet is said where the job is built to run)."""
    return ideal_of(cfg, build(cfg, warn=False).spec)


INSTANCE_SIZES = (1, 2, 4, 8)  # GPUs per model instance that ``ideals_by_size`` compares


def ideals_by_size(cfg: JobConfig, sizes: tuple[int, ...] = INSTANCE_SIZES) -> dict[int, IdealStep]:
    """The ideal step of job ``cfg`` with instances of each of ``sizes`` GPUs that divides the cluster, holds
    both models and is a layout the runtime builds (on one node, every model's heads cut evenly:
    ``pivotrl.sim.run.build`` refuses the others), each running a role on one engine; empty with measured
    costs (a profile is of the instance it measured). A step bound by its longest responses more than by its
    work has its lowest floor on larger instances than its highest ideal throughput."""
    if cfg.sim.costs not in ("roofline", "deployed"):  # (a profile is of the instance it measured)
        return {}
    out: dict[int, IdealStep] = {}
    for tp in sizes:
        if cfg.sim.gpus % tp:
            continue
        sim = dataclasses.replace(cfg.sim, instance_gpus=tp, rollout_engine_gpus=0, judge_engine_gpus=0,
                                  elastic_engines=False)  # fmt: skip
        try:  # (colocated: the job's split names devices of its own size)
            out[tp] = ideal_for_job(dataclasses.replace(cfg, mode="colocated", split="", tensor_parallel=1, sim=sim))
        except UserError:  # a model does not fit on tp GPUs, or cannot be cut in tp parts
            continue
    return out


def ideal_of(cfg: JobConfig, spec: SimSpec) -> IdealStep:
    """The ideal step of job ``cfg`` on the cluster ``spec`` models (the one ``build(cfg)`` gives)."""
    r = cfg.rollout
    return ideal_step(spec, r.prompts_per_step * r.group_size, r.max_new_tokens, cfg.judge.max_new_tokens,
                      group_size=r.group_size)  # fmt: skip


@dataclass(frozen=True, slots=True)
class JointFloor:
    """The joint floor, and the rollout it prices there: how long it runs and the GPU-seconds its decode takes,
    for the instances it keeps at each decode step (the choice that minimises the dual at its peak)."""

    seconds: float
    rollout_s: float
    rollout_gpu_s: float
    prefill_s: float = 0.0  # the rollout's first pass, every prompt read, before its first decode step
    # that rollout run by run after the prefill: (first decode step, decode steps, seconds, instances)
    runs: tuple[tuple[int, int, float, int], ...] = ()


def joint_floor(spec: SimSpec, samples: int, rollout_tokens: int, rest_gpu_s: float, after_s: float) -> JointFloor:
    """The shortest step any schedule of the rollout's instances allows, the tail and the work together
    (the module docstring's joint floor): the Lagrangian dual of choosing, at each decode step of the
    lock-step rollout, how many instances carry the responses still running. ``rest_gpu_s`` is the
    step's GPU-seconds besides the rollout's decode (at their ideal prices), ``after_s`` what must follow
    the last token (its judgment, its backward, the update)."""
    costs, tp, p, d = spec.role_costs(Role.ROLLOUT), spec.tp, spec.prompt_len, spec.devices
    b_max, gpus = spec.capacity(Role.ROLLOUT), spec.devices * spec.tp
    span = span_of(costs, spec.policy, tp)
    lengths = quantiles(spec.lengths, samples, rollout_tokens)
    # runs of decode steps: [alive at the run's first step, alive at its last, first step, steps]
    segments: list[list[int]] = []
    x = 1
    for i, length in enumerate(lengths):
        if length <= x:
            continue
        alive = samples - i
        if segments and alive >= MERGE * segments[-1][0]:
            segments[-1][1] = alive  # the run priced at its fewest: a relaxation, so still a floor
            segments[-1][3] += length - x
        else:
            segments.append([alive, alive, x, length - x])
        x = length
    fronts: list[list[tuple[float, float]]] = []  # per run: (seconds, GPU-seconds), Pareto-efficient only
    for _, alive, start, steps in segments:
        options = []
        for batch in range(min(b_max, max(1, -(-alive // d))), min(b_max, alive) + 1):
            seconds = span(batch, p + start, steps)
            options.append((seconds, tp * -(-alive // batch) * seconds))
        if alive > d * b_max:  # more than the cluster holds at once: the time of full batches, as on the
            seconds = span(b_max, p + start, steps)  # spread path, and every response's tokens at their price
            options = [(seconds, tp * alive / b_max * seconds)]
        options.sort()
        front = [options[0]]
        for o in options[1:]:
            if o[1] < front[-1][1]:
                front.append(o)
        fronts.append(front)
    prefill_s = costs.prefill(spec.policy, tp, min(b_max, -(-samples // d)) * p, p)

    def picked(lam: float) -> list[tuple[float, float]]:
        """Per run of decode steps, the (seconds, GPU-seconds) option that minimises the dual at ``lam``."""
        return [min(front, key=lambda o: lam * o[0] + (1 - lam) * o[1] / gpus) for front in fronts]

    def dual(lam: float) -> float:
        total = lam * (prefill_s + after_s) + (1 - lam) * rest_gpu_s / gpus
        return total + sum(lam * s + (1 - lam) * w / gpus for s, w in picked(lam))

    lo, hi = 0.0, 1.0  # the dual is concave in lam: golden-section search for its peak
    a, c = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    fa, fc = dual(a), dual(c)
    for _ in range(40):
        if fa < fc:
            lo, a, fa = a, c, fc
            c = lo + GOLDEN * (hi - lo)
            fc = dual(c)
        else:
            hi, c, fc = c, a, fa
            a = hi - GOLDEN * (hi - lo)
            fa = dual(a)
    value, lam = max((fa, a), (fc, c), (dual(0.0), 0.0), (dual(1.0), 1.0))
    choice = picked(lam)  # the rollout it prices there: its time (prefill included) and decode GPU-seconds
    # (a run holding more responses than the cluster's batches is priced at every response's share: all instances)
    runs = tuple((start, steps, s, min(d, round(w / (tp * s))) if s > 0 else 0)
                 for (_, _, start, steps), (s, w) in zip(segments, choice, strict=True))  # fmt: skip
    return JointFloor(value, prefill_s + sum(s for s, _ in choice), sum(w for _, w in choice), prefill_s, runs)
