"""``pivotrl simulate``: a job's control plane run against modeled devices.

    build(cfg) -> controller + SimDriver -> the loop of ``run_job`` -> the files of a real run

The job config means what it means for ``pivotrl train`` (mode, split, steps,
seed, rollout, judge and eval settings); ``sim.*`` says what is modeled, and
the devices are the model instances of ``sim.gpus``, ``tensor_parallel`` GPUs each
(``sim.instance_gpus`` once loaded: ``pivotrl.config.simulated_instances``). Problems are
stand-ins (every prompt costs ``sim.prompt_len`` tokens), so held-out accuracy and
judge agreement describe ``sim.yes_probability``, not a policy. Times in the
run's files are virtual seconds; the summary adds ``sim_seconds`` (virtual)
and ``wall_seconds`` (real).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.config import JobConfig, parse_split
from pivotrl.control.controller import Controller, LoopSpec
from pivotrl.control.drive import drive
from pivotrl.control.messages import Role
from pivotrl.control.modes import AllocationPolicy, make_policy
from pivotrl.control.profiles import Profiles, RoleProfile, TrainProfile
from pivotrl.control.shiftable import Shiftable
from pivotrl.errors import UserError
from pivotrl.log import logger
from pivotrl.resolve import DTYPE_BYTES, Hardware, Plan, resolve
from pivotrl.reward.genrm import GenRM
from pivotrl.runtime.devices import CPU, CUDA
from pivotrl.sample import Problem
from pivotrl.sim import synthetic
from pivotrl.sim.config import SimConfig
from pivotrl.sim.costs import OPTIMIZER_BYTES_PER_PARAM, CostModel, DeployedCosts, RooflineCosts, ScaledCosts
from pivotrl.sim.driver import SimDriver, SimSpec
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.measured import MeasuredCosts
from pivotrl.sim.models import MODELS, ModelSpec
from pivotrl.sim.workload import LengthDist, decode_context, length_moments, replay_table
from pivotrl.summary import loop_spec, sample_rows, summarize
from pivotrl.telemetry import RunWriter

KEEP_VERSIONS = 2  # policy versions the GPS holds, as the runtime keeps them


@dataclass(slots=True)
class Simulation:
    """Everything a simulated run needs, built and checked before anything is written."""

    cfg: JobConfig  # the job, ``devices`` set to the modeled instances
    spec: SimSpec
    loop: LoopSpec
    policy: AllocationPolicy
    genrm: GenRM
    train_set: list[Problem]
    heldout: list[Problem]
    plan: Plan  # the job resolved on the modeled GPUs


def _costs(cfg: JobConfig) -> CostModel:
    sim = cfg.sim
    if sim.costs == "roofline":
        return RooflineCosts(GPUS[sim.gpu])
    if sim.costs == "deployed":
        return DeployedCosts(GPUS[sim.gpu], policy_model=MODELS[sim.policy_model], judge_model=MODELS[sim.judge_model],
                             gpus=sim.gpus)  # fmt: skip
    if not Path(sim.costs).is_file():
        raise UserError(
            f"sim.costs: expected 'roofline', 'deployed' or a measured-costs JSON file, {sim.costs!r} not found"
        )
    if sim.instance_gpus != 1:
        raise UserError(f"tensor_parallel: measured costs are of one device per instance, got {sim.instance_gpus}")
    try:
        return MeasuredCosts.load(sim.costs)
    except ValueError as e:
        raise UserError(f"sim.costs: {e}") from None


def _lengths(cfg: JobConfig) -> LengthDist:
    sim, cap = cfg.sim, max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if not sim.lengths_file:
        return sim.lengths.dist(cap)
    if not Path(sim.lengths_file).is_file():
        raise UserError(f"sim.lengths_file: file {sim.lengths_file!r} not found")
    try:
        return LengthDist.from_trace(sim.lengths_file, cap)
    except ValueError as e:
        raise UserError(f"sim.lengths_file: {e}") from None


def _replay(cfg: JobConfig) -> dict[tuple[int, int], int] | None:
    if not cfg.sim.lengths_replay:
        return None
    try:
        return replay_table(cfg.sim.lengths_file)
    except ValueError as e:
        raise UserError(f"sim.lengths_replay: {e}") from None


def simulated_job(cfg: JobConfig) -> JobConfig:
    """``cfg`` as the simulator holds it, its instance size in ``sim.instance_gpus`` and its control plane's
    ``tensor_parallel`` 1 (``pivotrl.config.simulated_instances``, for a config loaded as a run's)."""
    tp = cfg.tensor_parallel
    if tp == 1:
        return cfg
    if cfg.sim.instance_gpus not in (1, tp):
        raise UserError(
            f"tensor_parallel: {tp} and sim.instance_gpus: {cfg.sim.instance_gpus} both name the instance size "
            "(sim.instance_gpus is the simulator's older name for it): give tensor_parallel alone"
        )
    return dataclasses.replace(cfg, tensor_parallel=1, sim=_with_instances(cfg.sim, tp))


def concrete_instances(cfg: JobConfig) -> JobConfig:
    """``simulated_job(cfg)`` with ``tensor_parallel=auto`` resolved on the modeled GPUs, as ``build`` does."""
    cfg = simulated_job(cfg)
    if cfg.sim.instance_gpus != "auto":
        return cfg
    return dataclasses.replace(cfg, sim=_with_instances(cfg.sim, build(cfg, warn=False).spec.tp))


def _with_instances(sim: SimConfig, tp: int | str) -> SimConfig:
    try:
        return dataclasses.replace(sim, instance_gpus=tp)
    except ValueError as e:
        raise UserError(f"sim.{e}") from None


def _check_node(sim: SimConfig) -> None:
    """An instance is on one node: no more GPUs than a node of the modeled GPU holds."""
    node = GPUS[sim.gpu].gpus_per_node
    if sim.instance_gpus != "auto" and sim.instance_gpus > node:
        raise UserError(
            f"tensor_parallel: {sim.instance_gpus} GPUs an instance, more than a node of {sim.gpu}s holds ({node}): "
            "an instance is on one node"
        )


def build(cfg: JobConfig, warn: bool = True) -> Simulation:
    """Check the job and set up its simulation; a mistake raises ``UserError`` naming the key. ``warn``: say
    what a run would meet (a trainer that fits no GPU, judgments cut at their cap); off for the ideals of a job
    already built, which would say it again for each."""
    cfg = simulated_job(cfg)
    sim = cfg.sim
    costs = _costs(cfg)
    policy_model, judge_model = MODELS[sim.policy_model], MODELS[sim.judge_model]
    measured = isinstance(costs, MeasuredCosts)
    if measured:  # measured costs tell the roles apart by model name
        policy_model = dataclasses.replace(policy_model, name=costs.rollout.model)
        judge_model = dataclasses.replace(judge_model, name=costs.genrm.model)
    shape = policy_model.train_config()
    r, j = cfg.rollout, cfg.judge
    rollout_context = sim.prompt_len + max(r.max_new_tokens, cfg.eval.max_new_tokens)
    judge_context = sim.prompt_len + r.max_new_tokens + sim.judge_template_len + j.max_new_tokens
    # the job resolved as the runtime would on the modeled GPUs, devices its GPUs and tensor_parallel those of
    # an instance, its models served by vLLM (train.backend=auto: ZeRO-1 in shiftable mode where it fits, else
    # FSDP2; tensor_parallel=auto: the fewest GPUs that hold each model; a size the models' heads cannot be cut
    # in is refused); a measured CPU profile's runtime trains replicated
    _check_node(sim)
    hw = Hardware(CPU) if measured else Hardware(CUDA, GPUS[sim.gpu].hbm_bytes, vllm=True)
    judge_shape = None if measured else judge_model.train_config()
    plan = resolve(dataclasses.replace(cfg, devices=sim.gpus, tensor_parallel=sim.instance_gpus, split=""), hw,
                   None if measured else shape, judge=judge_shape, judge_max_len=judge_context,
                   rollout_max_len=rollout_context)  # fmt: skip
    if plan.tensor_parallel != sim.instance_gpus:  # (auto, resolved)
        sim = _with_instances(sim, plan.tensor_parallel)
        cfg = dataclasses.replace(cfg, sim=sim)
        _check_node(sim)
    if not measured:  # the judge priced in the dtype a run would hold and serve it in
        judge_model = dataclasses.replace(judge_model, dtype_bytes=DTYPE_BYTES[plan.judge_dtype])
    if isinstance(costs, RooflineCosts) and shape is not None and plan.activation_checkpointing:
        costs = dataclasses.replace(costs, train_forwards=4.0)  # each layer's forward again in the backward
    if sim.shift_scale != 1 or sim.migration_scale != 1:
        costs = ScaledCosts(costs, float(sim.shift_scale), float(sim.migration_scale))
    genrm = GenRM(j.template, j.verdict_pattern, j.rewards, j.fallback_reward)
    by_reward = sorted(genrm.rewards, key=lambda label: genrm.rewards[label])
    verdicts = (synthetic.verdict_text(genrm, by_reward[0]), synthetic.verdict_text(genrm, by_reward[-1]))
    for label, text in zip((by_reward[0], by_reward[-1]), verdicts, strict=True):
        if text is None:
            raise UserError(
                f"judge.verdict_pattern: the simulator cannot write a judgment that {j.verdict_pattern!r} "
                f"parses to {label!r}"
            )
    lengths, replay, judge_lengths = _lengths(cfg), _replay(cfg), sim.judge_lengths(j.max_new_tokens)
    if sim.judge_output_sigma and warn:
        _warn_capped_judgments(judge_lengths)
    spec = SimSpec(
        devices=sim.devices,
        tp=sim.instance_gpus,
        costs=costs,
        policy=policy_model,
        genrm=judge_model,
        lengths=lengths,
        group_correlation=float(sim.group_correlation),
        replay=replay,
        seed=cfg.seed,
        prompt_len=sim.prompt_len,
        max_batch=r.max_batch,
        rollout_context=rollout_context,
        judge_context=judge_context,
        judge_template_len=sim.judge_template_len,
        judge_lengths=judge_lengths,
        yes_probability=float(sim.yes_probability),
        verdicts=(verdicts[0] or "", verdicts[1] or ""),
        slice_s=float(sim.slice_s),
        react_s=float(sim.react_s),
        paged=sim.kv_cache == "paged",
        rollout_decode_context=decode_context(sim.prompt_len, lengths, r.max_new_tokens),
        judge_decode_context=decode_context(
            sim.prompt_len + length_moments(lengths, r.max_new_tokens)[0] + sim.judge_template_len,
            judge_lengths,
            j.max_new_tokens,
        ),
        engine_tp=(
            _engine_gpus(sim, costs, policy_model, sim.rollout_engine_gpus, rollout_context),
            _engine_gpus(sim, costs, judge_model, sim.judge_engine_gpus, judge_context),
        ),  # fmt: skip
        elastic=sim.elastic_engines,
        lockstep_train=plan.traits.lockstep,
    )
    checks = ((Role.ROLLOUT, sim.policy_model, spec.rollout_context, "rollout_engine_gpus"),
              (Role.JUDGE, sim.judge_model, spec.judge_context, "judge_engine_gpus"))  # fmt: skip
    for role, name, context, key in checks:
        if spec.capacity(role) >= 1:
            continue
        if measured:  # a measured engine holds the longest sequence of the run it was fitted to, whatever the GPUs
            base = costs.base if isinstance(costs, ScaledCosts) else costs
            m = base.rollout if role is Role.ROLLOUT else base.genrm
            what, new, keys, limits = (
                ("rollout", max(r.max_new_tokens, cfg.eval.max_new_tokens), "sim.prompt_len",
                 "rollout/eval.max_new_tokens")
                if role is Role.ROLLOUT
                else ("judge", r.max_new_tokens + j.max_new_tokens, "sim.prompt_len + sim.judge_template_len",
                      "rollout.max_new_tokens + judge.max_new_tokens")
            )  # fmt: skip
            fix = (f"{keys} is {context - new}, at most {m.max_len - new} fits beside {new} new tokens ({limits})"
                   if m.max_len > new else f"{new} new tokens ({limits}) leave no room for {keys}")  # fmt: skip
            raise UserError(
                f"sim.costs: the measured {what} engine ({m.model!r}) holds sequences of up to {m.max_len} "
                f"tokens, its run's prompts and limits; this job's are {context}: {fix}"
            )
        engine = getattr(sim, key)
        if engine and engine < sim.instance_gpus:  # the instance may hold it, one of its engines does not
            raise UserError(
                f"sim.{key}: {name} with {context}-token sequences does not fit on an engine of "
                f"{engine} x {sim.gpu} (give each engine more GPUs, up to tensor_parallel = {sim.instance_gpus})"
            )
        raise UserError(
            f"tensor_parallel: {name} with {context}-token sequences does not fit on "
            f"{sim.instance_gpus} x {sim.gpu} (give an instance more GPUs)"
        )
    # an engine runs no more sequences than its KV memory holds; handing it more only queues them
    # inside it, out of reach of devices that join the role later
    judge_batch, judge_kv = spec.capacity(Role.JUDGE), spec.kv_tokens(Role.JUDGE)
    r = dataclasses.replace(r, max_batch=spec.capacity(Role.ROLLOUT))
    # the fewest train devices (the plan's: the fewest GPUs the trainer's state fits on, over the GPUs of an
    # instance): the optimizer step waits for as many instances, as the runtime's train.min_devices=auto
    if plan.too_big and warn:  # (a run would stop on it; the simulation prices the step as if the state fitted)
        logger.warning("%s (%s on %ss): a run would not fit it; the simulation prices it anyway", plan.too_big,
                       sim.policy_model, sim.gpu)  # fmt: skip
    min_train = plan.min_train_devices
    try:
        alloc = make_policy(cfg.mode, sim.devices, parse_split(cfg.split), r.max_batch, r.max_new_tokens,
                            j.max_new_tokens, r.prompts_per_step * r.group_size, min_train)  # fmt: skip
        train = dataclasses.replace(cfg.train, backend=plan.trainer.value)  # (auto made concrete, as a run's is)
        job = dataclasses.replace(cfg, devices=sim.devices, rollout=r, train=train)
    except ValueError as e:
        raise UserError(f"{e} (the simulator's devices are sim.gpus / tensor_parallel = {sim.devices})") from None
    # the modeled engines' capacities are what this hardware answers for the rollout's and the judge's limits
    plan = dataclasses.replace(plan, rollout_per_device=0, judge_per_device=judge_batch, judge_kv=judge_kv or 0)
    if isinstance(alloc, Shiftable):
        _startup_profile(alloc.profiles, spec)
        alloc.max_batch = (r.max_batch, judge_batch)
        alloc.judge_kv = judge_kv
    train_set = synthetic.problems(max(r.prompts_per_step, 1024))
    heldout = synthetic.problems(cfg.eval.size, tag="h")
    loop = loop_spec(job, plan, simulated=True)
    return Simulation(job, spec, loop, alloc, genrm, train_set, heldout, plan)


def _engine_gpus(sim: SimConfig, costs: CostModel, model: ModelSpec, given: int, context: int) -> int:
    """GPUs of each engine of a role: the job's, or with elastic engines and none given, the fewest
    (a power of two dividing the instance) whose memory holds the model and one ``context``-token sequence."""
    if given or not sim.elastic_engines:
        return given
    for g in (2**i for i in range(sim.instance_gpus.bit_length())):
        if sim.instance_gpus % g == 0 and costs.max_batch(model, g, context):
            return g
    return 0


CAPPED_JUDGMENTS_WARN = 0.05  # share of spread judgments reaching the cap worth a warning: they have no verdict


def _warn_capped_judgments(judgments: LengthDist, grid: int = 1000) -> None:
    """Spread judgments reaching ``judge.max_new_tokens`` are cut before their verdict (garbage, counted,
    the fallback reward): say so when that is more than a few, since the cap was likely left as it was."""
    share = sum(judgments.quantile((i + 0.5) / grid) >= judgments.cap for i in range(grid)) / grid
    if share > CAPPED_JUDGMENTS_WARN:
        logger.warning(
            "sim.judge_output_sigma: %.0f%% of judgments reach judge.max_new_tokens (%d, %.1fx sim.judge_output_len) "
            "and have no verdict; raise judge.max_new_tokens to keep them",
            100 * share, judgments.cap, judgments.cap / judgments.median,
        )  # fmt: skip


LONGER_WARMUP = 4  # the start-up measurement's second context, this many times the first


def _startup_profile(profiles: Profiles, spec: SimSpec) -> None:
    """The planner's priors from the devices it runs on, as an engine measures itself when it
    starts (decode steps at batches 1, 2, 4, ... up to its capacity, each at a typical context and a
    longer one, a prefill, a training pass):
    its first plans are made for these devices, not for the runtime's CPU defaults. Measurements
    of the run replace them as they come."""
    tp, ref = spec.tp, 32
    response = spec.lengths.quantile(0.5)

    def profile(role: Role, context: int) -> RoleProfile:
        c, capacity = spec.role_costs(role), spec.capacity(role)
        model = spec.policy if role is Role.ROLLOUT else spec.genrm
        # the step's line in the batch at ``context``, and how much a longer context adds to it
        longer = LONGER_WARMUP * context
        one, many = c.decode_step(model, tp, 1, context), c.decode_step(model, tp, ref, context)
        per_kv = max(0.0, (c.decode_step(model, tp, ref, longer) - many) / (ref * (longer - context)))
        per_seq = max(0.0, (many - one) / (ref - 1) - per_kv * context)
        base = max(one - per_seq - per_kv * context, 1e-6)
        out = RoleProfile(step_base=base, step_per_seq=per_seq, step_per_kv=per_kv, context=context, ref_batch=ref)
        for b in (2**i for i in range(capacity.bit_length())):  # 64 warm-up steps at each batch and context
            for ctx in (context, longer):
                out.observe(64 * b, 64 * c.decode_step(model, tp, b, ctx), b, ctx)
        return out

    judge_prompt = spec.prompt_len + response + spec.judge_template_len
    profiles.rollout = profile(Role.ROLLOUT, spec.prompt_len + response)
    judgment = spec.judge_lengths.quantile(0.5)
    profiles.judge = profile(Role.JUDGE, judge_prompt + judgment // 2)
    tokens = 16 * (spec.prompt_len + response)
    profiles.train = TrainProfile(device_rate=tokens / spec.costs.train_tokens(spec.policy, tokens, tp))
    rollout, judge = spec.role_costs(Role.ROLLOUT), spec.role_costs(Role.JUDGE)
    profiles.rollout.prefill_rate = 4096 / rollout.prefill(spec.policy, tp, 4096, spec.prompt_len + response)
    profiles.judge.prefill_rate = judge_prompt / judge.prefill(spec.genrm, tp, judge_prompt)


def gps_bytes(spec: SimSpec) -> dict[str, int]:
    """What the GPS would hold: policy weights of the kept versions and its optimizer state, the judge."""
    policy = spec.policy.weight_bytes * KEEP_VERSIONS + spec.policy.total_params * OPTIMIZER_BYTES_PER_PARAM
    out = {"policy": int(policy), "judge": int(spec.genrm.weight_bytes)}
    return {**out, "total": sum(out.values())}


def run_simulation(cfg: JobConfig, out: str | Path, progress: bool = False) -> dict[str, Any]:
    """Simulate the whole job; writes a run directory like ``run_job``'s (no policy checkpoint)."""
    # millions of short-lived objects and few cycles: the collector's pauses were a third of the time.
    # It comes back once the run's objects went with ``_simulate``'s frame, by reference counting:
    # enabled before, its first pass would walk every one of them (most of a second at 1024 GPUs)
    gc.disable()
    try:
        return _simulate(cfg, out, progress)
    finally:
        gc.enable()


def _simulate(cfg: JobConfig, out: str | Path, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    started = time.perf_counter()
    s = build(cfg)
    job, spec = s.cfg, s.spec
    driver = SimDriver(spec)
    writer = RunWriter(out)
    writer.write_json("config.json", job.to_dict())
    ctl = Controller(s.loop, s.policy, s.genrm, s.train_set, s.heldout, driver.clock)
    desc = f"simulate ({job.mode}, {job.sim.gpus} x {job.sim.gpu})"
    bar = tqdm(total=job.steps, desc=desc, unit="step", disable=not progress)
    written = 0

    def after() -> None:  # completions at one virtual instant handled: the finished steps' rows
        nonlocal written
        if ctl.finished_steps:
            writer.samples(sample_rows(ctl.finished_steps, token_ids=False))
            ctl.finished_steps.clear()
        while written < len(ctl.metrics):
            m = ctl.metrics[written]
            writer.step(m)
            written += 1
            bar.update(1)
            bar.set_postfix(sim_s=f"{driver.clock():.0f}", step_s=f"{m['step_seconds']:.1f}")

    stats = drive(ctl, driver, after)
    bar.close()
    slices = driver.slices()
    summary = summarize(job, ctl, slices, driver.clock())
    summary["policy_checkpoint"] = None  # nothing is trained
    summary["train_backend"], summary["train_min_devices"] = job.train.backend, s.loop.min_train_devices  # (as a run's)
    summary["gps_bytes"] = gps_bytes(spec)
    summary["sim"] = {"gpu": job.sim.gpu, "gpus": job.sim.gpus, "instance_gpus": spec.tp,
                      "policy_model": job.sim.policy_model, "judge_model": job.sim.judge_model,
                      "lengths": spec.lengths.describe(), "slice_s": spec.slice_s, "events": stats.events,
                      "kv_cache": job.sim.kv_cache, "preemptions": driver.preemptions(),
                      "engine_gpus": {"rollout": spec.engine_tp[0] or spec.tp, "judge": spec.engine_tp[1] or spec.tp},
                      "elastic_engines": spec.elastic, "costs": job.sim.costs,
                      "shift_scale": job.sim.shift_scale, "migration_scale": job.sim.migration_scale,
                      "train_forwards": _train_forwards(spec.costs)}  # fmt: skip
    summary["sim_seconds"] = driver.clock()
    summary["sim"]["ideal"] = _bounds(job, spec, summary)
    title = f"simulated {job.mode}, {job.sim.gpus} x {job.sim.gpu} ({spec.devices} instances), {job.steps} steps"
    writer.write_events(slices, title=title, metrics=ctl.metrics)
    planner = getattr(s.policy, "planner", None)
    if planner is not None:  # every decision that moved a device, with the estimate that justified it
        writer.write_jsonl("decisions.jsonl", [d.row() for d in planner.log])
    summary["wall_seconds"] = wall = time.perf_counter() - started
    summary["wall_split"] = {"driver": stats.driver_s, "control_plane": stats.control_s,
                             "rest": wall - stats.driver_s - stats.control_s}  # fmt: skip
    writer.write_json("summary.json", summary)
    logger.info("simulated run written to %s", out)
    return summary


def _bounds(job: JobConfig, spec: SimSpec, summary: dict[str, Any]) -> dict[str, float]:
    """What any schedule could do with this job on this cluster (``pivotrl.sim.ideal``): the ideal
    throughput, the shortest step (the floor), and the share of the floor's throughput the run's steady
    steps reach: how much a better schedule could still gain here."""
    from pivotrl.sim.ideal import ideal_of  # (it builds jobs with this module's ``build``)

    ideal = ideal_of(job, spec)
    floor = ideal.floor_samples_per_s
    out = {"samples_per_s": ideal.samples_per_s, "floor_seconds": ideal.floor_seconds,
           "floor_samples_per_s": floor, "steady_of_floor": summary["steady_samples_per_s"] / floor}  # fmt: skip
    if ideal.lockstep_floor_s:  # a trainer that backpropagates at the step: the floor of its schedules
        held = ideal.samples / ideal.lockstep_floor_s
        out |= {"lockstep_floor_seconds": ideal.lockstep_floor_s, "steady_of_lockstep_floor":
                summary["steady_samples_per_s"] / held}  # fmt: skip
    return out


def format_sizes(job: JobConfig) -> str | None:
    """A line naming the instance sizes whose floor (``pivotrl.sim.ideal.ideals_by_size``) allows 2% more
    than the job's own (None if none does, or with measured costs)."""
    from pivotrl.sim.ideal import ideal_for_job, ideals_by_size

    job = concrete_instances(job)
    sim = job.sim
    floors = {tp: i.floor_samples_per_s for tp, i in ideals_by_size(job).items()}
    own = floors.get(sim.instance_gpus)
    # (an engine of all the instance's GPUs is one engine a role)
    engines = sim.elastic_engines or any(
        0 < g < sim.instance_gpus for g in (sim.rollout_engine_gpus, sim.judge_engine_gpus)
    )
    if own is not None and engines:
        own = ideal_for_job(job).floor_samples_per_s  # its instances run a role on several engines
    better = {tp: rate for tp, rate in floors.items() if own is not None and rate > 1.02 * own}
    if not better:
        return None
    what = "instances of {} GPUs, one engine a role" if engines else "instances of {} GPUs"
    sizes = ", ".join(f"{rate:.1f} samples/s on {what.format(tp)}" for tp, rate in sorted(better.items()))
    best = max(better, key=lambda tp: better[tp])
    try_ = f"tensor_parallel={best}"
    for key, off in (("rollout_engine_gpus", 0), ("judge_engine_gpus", 0), ("elastic_engines", "false")):
        if engines and getattr(sim, key):
            try_ += f" sim.{key}={off}"
    return (
        f"the floor allows {sizes} ({own:.1f} here): these steps wait on their longest responses more than "
        f"on their work; try {try_}"
    )


def _engines(sim: dict[str, Any]) -> str:
    """``, rollout on 2 engines of 2``: how the instances run their roles, where not on one engine each."""
    tp, engines = sim["instance_gpus"], sim.get("engine_gpus", {})
    if sim.get("elastic_engines"):
        sizes = ", ".join(f"{g} ({role})" for role, g in engines.items())
        return f", engines elastic from {sizes} GPUs to {tp}: a bound"
    return "".join(f", {role} on {tp // g} engines of {g}" for role, g in engines.items() if g != tp)


def _costs_text(costs: str) -> str:
    """What the run's costs were, where not the datasheet's roofline."""
    if costs == "roofline":
        return ""
    if costs == "deployed":
        return ", phase switches at deployed frameworks' published costs"
    return f", costs measured in {Path(costs).name}"


def _train_forwards(costs: CostModel) -> float | None:
    """Forward passes a trained token is priced at (4: activation checkpointing), None for measured costs."""
    return getattr(getattr(costs, "base", costs), "train_forwards", None)


def _training_text(sim: dict[str, Any]) -> str:
    forwards = sim.get("train_forwards")
    return ", training with activation checkpointing (4 forward passes a token)" if forwards == 4 else ""


def _what_if_text(sim: dict[str, Any]) -> str:
    """``, shifts free (a what-if)``: the costs scaled from the model's, if any."""
    parts = []
    for key, what in (("shift_scale", "shifts"), ("migration_scale", "migrations")):
        scale = sim.get(key, 1)
        if scale != 1:
            parts.append(f"{what} free" if scale == 0 else f"{what} at {scale:g}x their cost")
    return f", {' and '.join(parts)} (a what-if)" if parts else ""


def format_sim(summary: dict[str, Any]) -> str:
    """The simulator's lines under the run summary: what was modeled, virtual and real time, and how
    far the run is from what any schedule could do."""
    sim = summary["sim"]
    per_step = summary["sim_seconds"] / max(summary["steps"], 1)
    ideal = sim["ideal"]
    return (
        f"simulated {summary['sim_seconds']:.1f} s ({per_step:.1f} s/step) on {sim['gpus']} x {sim['gpu']} "
        f"({summary['devices']} instances of {sim['instance_gpus']} GPU{_engines(sim)}), {sim['policy_model']} policy, "
        f"{sim['judge_model']} judge, {sim['kv_cache']} KV cache ({sim['preemptions']} preemptions)"
        f"{_costs_text(sim.get('costs', 'roofline'))}{_training_text(sim)}{_what_if_text(sim)}; "
        f"{summary['wall_seconds']:.1f} s of wall time\n"
        f"ideal {ideal['samples_per_s']:.1f} samples/s; no schedule's step is shorter than "
        f"{ideal['floor_seconds']:.1f} s ({ideal['floor_samples_per_s']:.1f} samples/s): the steady steps "
        f"reach {100 * ideal['steady_of_floor']:.0f}% of that" + _lockstep_text(ideal)
    )


def _lockstep_text(ideal: dict[str, Any]) -> str:
    """The floor of a trainer that backpropagates at the step (FSDP2), where the run's has one."""
    if not ideal.get("lockstep_floor_seconds"):
        return ""
    return (
        f"; with a trainer that backpropagates at the step (train.backend=fsdp) none is shorter than "
        f"{ideal['lockstep_floor_seconds']:.1f} s, {100 * ideal['steady_of_lockstep_floor']:.0f}% reached"
    )
