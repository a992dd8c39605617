"""Run a job: the control plane driven over real devices.

    controller.start() -> commands -> driver -> events -> controller.handle() -> ...

One device runs in this process (``LocalDriver``); more devices, or
``--ray-address``, run one Ray actor per device (``RayDriver``). Both load
every role's weights from the Global Parameter Storage.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pivotrl import checkpoint as ckpt
from pivotrl import tracking
from pivotrl.config import FaultConfig, JobConfig, config_from_dict, parse_split
from pivotrl.control.controller import Controller, DeviceLostError
from pivotrl.control.drive import drive
from pivotrl.control.messages import Command, Step
from pivotrl.control.modes import AllocationPolicy, make_policy
from pivotrl.engine.kv_budget import GB
from pivotrl.engine.vllm_engine import INSTALL as VLLM_INSTALL
from pivotrl.engine.vllm_engine import available as vllm_available
from pivotrl.errors import RunInterrupted, TrainingDiverged, UserError
from pivotrl.gps import Kind, LocalStore, ParameterStore
from pivotrl.log import logger
from pivotrl.model import load_model, save_model
from pivotrl.model.chat import ChatTemplate, copy_chat_template, load_chat_template
from pivotrl.model.loader import DTYPES, read_config
from pivotrl.resolve import (
    PROMPT_BOUND,
    Hardware,
    Plan,
    backend_note,
    base_trainer,
    changed,
    precision_for,
    resolve,
    rollout_dtype_for,
    sequence_lengths,
)
from pivotrl.reward import GenRM
from pivotrl.reward.genrm import judge_prompt
from pivotrl.runtime import devices as dev
from pivotrl.runtime.contexts import (
    CHECKPOINT_STATE,
    JUDGE,
    POLICY,
    REFERENCE,
    ContextSpec,
    build_model,
    publish_checkpoint,
)
from pivotrl.runtime.engine_host import engine_processes
from pivotrl.runtime.local import LocalDriver
from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.sample import Problem
from pivotrl.summary import loop_spec, sample_rows, summarize
from pivotrl.task.data import read_task
from pivotrl.telemetry import RunWriter, missing_rows
from pivotrl.train.group import collective_timeout
from pivotrl.train.shards import shard_name
from pivotrl.train.traits import TrainerKind, traits
from pivotrl.train.zero import check_dtypes


def chat_templates(cfg: JobConfig) -> tuple[ChatTemplate | None, ChatTemplate | None]:
    """The policy's and the judge's chat templates, read from their checkpoints where the config turns
    them on (``task.chat_template``, ``judge.chat_template``); a missing or broken one stops the job here."""
    policy = judge = None
    if cfg.task.chat_template.enabled:
        policy = load_chat_template(cfg.policy.path, "task.chat_template", cfg.task.chat_template.system)
    if cfg.judge.chat_template.enabled:
        judge = load_chat_template(cfg.judge.path, "judge.chat_template", cfg.judge.chat_template.system)
    return policy, judge


def context_spec(
    cfg: JobConfig,
    problems: list[Problem] | None = None,
    device: str = "cpu",
    policy_chat: ChatTemplate | None = None,
    judge_chat: ChatTemplate | None = None,
) -> ContextSpec:
    """KV-cache lengths from the job (``pivotrl.resolve.sequence_lengths``): the longest prompt of
    ``problems`` (in UTF-8 bytes plus special tokens, a bound on its token count for byte-level and
    character tokenizers; 256 when no problems are given) plus the generation limits. Prompts
    are measured as the models read them, in their chat templates (``*_chat``) if any. Smaller
    caches make every shift into a generation role cheaper (they are allocated then).

    What the job's plan resolves (the models' dtypes, their backends, the migration audit) is left empty: the
    plan is made once the devices are up, and the driver configures every device with it before any context
    is built (``Worker.configure``, ``Plan.serving``)."""
    shared = dev.shares_gpu(device, cfg.gpus_per_device, cfg.devices)
    if shared and not traits(base_trainer(cfg.train, device, shared)).host_collectives:
        raise UserError(
            f"train.backend=fsdp cannot train on devices that share a GPU (gpus_per_device="
            f"{cfg.gpus_per_device}): NCCL takes one rank per GPU and FSDP2's collectives need it; use "
            "train.backend=zero or replicated, whose few collectives go through host memory there"
        )
    if base_trainer(cfg.train, device, shared) is TrainerKind.ZERO:  # (it computes from the rollout's weights)
        compute = torch.bfloat16 if precision_for(cfg.train, device) == "bf16" else torch.float32
        try:  # (a mistake in the job, said before the devices start: the rollout's width is the kind's alone)
            check_dtypes(compute, DTYPES[rollout_dtype_for(cfg, device)])
        except ValueError as e:
            raise UserError(str(e)) from None
    if problems:
        template = cfg.task.prompt_template
        policy = [template.format(question=p.question) for p in problems]
        prompt = max(len((policy_chat(q) if policy_chat else q).encode()) for q in policy) + 4
        judge_prompt_len = 4 + max(
            len(judge_prompt(cfg.judge.template, p.question, p.reference, "", judge_chat).encode()) for p in problems
        )
    else:
        prompt = judge_prompt_len = PROMPT_BOUND
    max_len, judge_max_len = sequence_lengths(cfg, prompt, judge_prompt_len)
    return ContextSpec(
        device=device,
        policy_dtype=cfg.policy.dtype,
        rollout_dtype="",
        judge_dtype="",
        max_batch=cfg.rollout.max_batch,
        max_len=max_len,
        judge_max_len=judge_max_len,
        judge_template=cfg.judge.template,
        judge_chat=judge_chat,
        policy_chat=policy_chat is not None,
        kv_cache_bytes=int(cfg.rollout.kv_cache_gb * GB),
        memory_share=cfg.gpus_per_device,  # devices sharing a GPU size their caches from their share of it
        devices=cfg.devices,
        shared_gpu=shared,
        rollout_backend="",
        judge_backend="",
    )


def publish_initial(store: ParameterStore, cfg: JobConfig, plan: Plan, resume: ckpt.Checkpoint | None = None) -> None:
    """Policy version 0 (or the resumed checkpoint's version and optimizer state) and the judge go into the GPS;
    devices load only from there. The judge is held once, in the dtype it is served in (the plan's)."""
    policy, ptok = load_model(cfg.policy.path, cfg.policy.dtype)
    if resume is None:
        publish_checkpoint(store, POLICY, 0, policy, ptok)
    else:
        resume.restore(store)
    if cfg.train.kl_coef > 0:  # the KL reference outlives the policy versions the GPS keeps
        publish_checkpoint(store, REFERENCE, 0, policy, ptok)
    judge, jtok = load_model(cfg.judge.path, plan.judge_dtype)
    publish_checkpoint(store, JUDGE, 0, judge, jtok)


# keys a resume may change: a drill (never replayed), where numbers are sent, how faults and checkpoints are handled
OPERATIONAL = ("fault", "log", "restart_lost", "device_timeout", "checkpoint")


def resumable(cfg: JobConfig, out: str | Path) -> ckpt.Checkpoint:
    """The checkpoint ``out`` resumes from, once it is clear the run can go on from it."""
    if not (Path(out) / "config.json").is_file():
        raise ckpt.CheckpointError(f"{out}: not a run directory (no config.json)")
    start = ckpt.latest(out)
    saved, now = config_from_dict(start.state["config"]).to_dict(), cfg.to_dict()  # (new keys: defaults)
    for key in OPERATIONAL:  # how the run is operated, not what it computes: a resume may change these
        saved.pop(key, None), now.pop(key, None)
    if saved != now:
        changed = sorted(_diff(saved, now))
        raise ckpt.CheckpointError(
            f"{out}: the config differs from the run's ({', '.join(changed)}); resume with the run's own config"
        )
    summary = Path(out) / "summary.json"
    if summary.is_file() and start.step < cfg.steps and _finished(summary, cfg.steps):
        raise ckpt.CheckpointError(f"{out}: the run finished all {cfg.steps} steps; nothing to resume")
    short = missing_rows(out, (start.state["metrics_rows"], start.state["samples_rows"]))
    if short:  # (checked before anything is cut: a refused resume leaves the files as they were)
        raise ckpt.CheckpointError(
            f"{out}: cannot resume from {start.path.name}: {short} (the file was changed since); restore it, "
            "or start a new run with --out"
        )
    logger.info("resuming %s from step %d (%s)", out, start.step, start.path.name)
    return start


def resumed_drill(cfg: JobConfig, saved: dict[str, Any]) -> JobConfig:
    """``cfg`` for a resume of the run whose config was ``saved``: the run's own drill (``fault.*``) happened once, in
    the run resumed, and is not replayed; a drill the resume is given instead runs."""
    return replace(cfg, fault=FaultConfig()) if cfg.fault == config_from_dict(saved).fault else cfg


def check_train_size(cfg: JobConfig, problems: int) -> None:
    """A step draws ``rollout.prompts_per_step`` distinct problems: the train file must hold that many."""
    if cfg.rollout.prompts_per_step > problems:
        raise UserError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: task.train_file {cfg.task.train_file} holds "
            f"only {problems} problems; lower rollout.prompts_per_step to at most {problems} or use a larger file"
        )


def resume_hint(out: str | Path) -> str:
    """How to continue the run in ``out`` once it stopped, and from where."""
    newest = sorted((Path(out) / ckpt.DIR).glob(f"{ckpt.PREFIX}*"))
    if not newest:  # (--resume needs a checkpoint, and --out refuses a directory that holds a run)
        return f"no checkpoint yet: start it again with another --out (or remove {out} first)"
    return f"resume with: pivotrl train --resume {out} (newest checkpoint: {newest[-1].name})"


DIVERGED_STEPS = 3  # consecutive updates skipped for a gradient norm that is not finite: the run stops


def diverged(rows: list[dict[str, Any]], lr: float) -> str | None:
    """Why the run must stop, where its last ``DIVERGED_STEPS`` steps each skipped their update because the
    gradient norm was not finite (None otherwise). One such step is skipped and the run goes on (a rare
    overflow); several in a row mean the weights themselves are no longer finite, and every later step would
    skip too, and end in a policy of NaN weights."""
    last = rows[-DIVERGED_STEPS:]
    if len(last) < DIVERGED_STEPS or not all(_nonfinite(m.get("train_grad_norm")) for m in last):
        return None
    return (
        f"training diverged: the gradient norm was not finite at steps {last[0]['step']}-{last[-1]['step']}, so "
        f"their updates were skipped and the weights are likely no longer finite; start again with a lower "
        f"train.lr (now {lr:g}) or a train.grad_clip"
    )


def _nonfinite(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def _finished(summary: Path, steps: int) -> bool:
    import json

    try:
        return json.loads(summary.read_text()).get("steps") == steps
    except ValueError:
        return False


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [path]


def shard_copies(store: ParameterStore, version: int, world: int) -> list[ckpt.Entry]:
    """The shards of ``version`` a sharded train group of ``world`` devices copied for a checkpoint (none when the
    trainer is replicated), each to be kept under its own name."""
    return [
        ckpt.Entry(shard_name(CHECKPOINT_STATE, r, world), shard_name(POLICY, r, world), version, Kind.OPTIMIZER)
        for r in range(world)
        if version in store.versions(shard_name(CHECKPOINT_STATE, r, world), Kind.OPTIMIZER)
    ]


def save_checkpoint(
    cfg: JobConfig,
    out: str | Path,
    store: ParameterStore,
    ctl: Controller,
    copies: list[ckpt.Entry],
    metrics_rows: int,
    samples_rows: int,
    plan: Plan | None = None,
) -> None:
    """Write the checkpoint of the step just finished (``ctl.checkpoint_due``) from the GPS: the weights, and the
    optimizer state (the sharded trainer's ``copies``, or the replicated trainer's, which rank 0 publishes every
    step)."""
    state = ctl.checkpoint()
    version = state["version"]
    entries = [ckpt.Entry(POLICY, POLICY, version, Kind.WEIGHTS), *copies]
    if not copies and version in store.versions(POLICY, Kind.OPTIMIZER):
        entries.append(ckpt.Entry(POLICY, POLICY, version, Kind.OPTIMIZER))
    meta = {"step": state["step"], "config": cfg.to_dict(), "controller": state, "train_state_world": len(copies)}
    meta |= {"metrics_rows": metrics_rows, "samples_rows": samples_rows}
    if plan is not None:  # (what the job resolved to: a resumed run reads the state this trainer wrote)
        meta["train_backend"], meta["plan"] = plan.trainer.value, plan.to_dict()
    ckpt.write(out, store, entries, meta, cfg.checkpoint.keep)


AUTO_RESUMES = 3  # in-run resumes after losses nothing else can recover from, at most


def run_job(
    cfg: JobConfig,
    out: str | Path,
    progress: bool = True,
    ray_address: str | None = None,
    policy: AllocationPolicy | None = None,
    in_process: bool | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run the whole job; writes the run directory (metrics, summary, events, trace, timeline, policy).

    A device lost with state nothing else holds (its shard of a sharded train
    state) stops this attempt; with ``restart_lost`` the job then resumes
    itself from its newest checkpoint (from the start when there is none yet),
    on devices started afresh, up to :data:`AUTO_RESUMES` times: the samples
    are those of an undisturbed run, the steps since the checkpoint are done
    twice. ``summary.json``'s ``auto_resumed`` lists each time.
    """
    auto: list[dict[str, Any]] = []
    while True:
        try:
            summary = _run_once(cfg, out, progress, ray_address, policy, in_process, resume)
        except TrainingDiverged:
            raise  # (the same steps again would diverge the same way)
        except RunInterrupted as e:
            if not cfg.restart_lost or len(auto) >= AUTO_RESUMES:
                raise
            resume = ckpt.has_checkpoint(out)
            cfg = replace(cfg, fault=FaultConfig())  # a drill fires once
            auto.append({"reason": str(e.__cause__ or e), "from": "checkpoint" if resume else "the start"})
            logger.warning("%s: the run resumes from %s", e.__cause__ or e, auto[-1]["from"])
            continue
        if auto:
            summary["auto_resumed"] = auto
            RunWriter.rewrite_json(Path(out) / "summary.json", summary)
        return summary


def _device_memory(cfg: JobConfig, kind: str, driver: Any) -> float | None:
    """Bytes of GPU memory each device has (its share of a GPU), or None on CPUs: the Ray devices' smallest, as
    they report it (``driver``), or this process's GPU shared by the devices in it."""
    if kind != dev.CUDA:
        return None
    if driver is None:  # (the share each device plans with, as the devices do: ContextSpec.memory_share)
        return dev.gpu_memory() * min(1.0, cfg.gpus_per_device)
    if not driver.bindings or any(b.memory_bytes <= 0 for b in driver.bindings):
        return None  # (GPUs their torch cannot use: they compute on the CPU)
    return min(b.memory_bytes for b in driver.bindings) * min(1.0, cfg.gpus_per_device)


def _bf16(kind: str, driver: Any) -> bool:
    """Whether the devices' GPUs compute in bfloat16: every Ray device's, as it reports it (``driver``), or this
    process's GPU (True where they compute on CPUs: no GPU's limit)."""
    if kind != dev.CUDA:
        return True
    if driver is None:
        return dev.bf16_supported()
    return all(b.bf16 for b in driver.bindings)


def _on_cuda(kind: str, driver: Any) -> bool:
    """Whether the devices compute on CUDA (Ray devices holding GPU shares their torch cannot use do not)."""
    return kind == dev.CUDA and (driver is None or all(b.kind == dev.CUDA for b in driver.bindings))


def resolve_run(
    cfg: JobConfig,
    kind: str,
    device_bytes: float | None,
    spec: ContextSpec,
    start: ckpt.Checkpoint | None = None,
    *,
    bf16: bool = True,
    vllm: bool = False,
) -> Plan:
    """The job resolved against its devices (``pivotrl.resolve``), the architectures read from the checkpoints
    where the memory rules need them. ``bf16``: their GPUs compute in bfloat16; ``vllm``: vLLM can serve them. A
    resumed run keeps the trainer that wrote its state (a checkpoint from before the plan was kept: its
    ``train_backend``, or auto's rule by the devices' kind), and says what else resolved differently on these
    devices. What the devices cannot hold is one line naming the key."""
    shared = dev.shares_gpu(kind, cfg.gpus_per_device, cfg.devices)
    hw = Hardware(kind, device_bytes, shared, bf16, vllm)  # type: ignore[arg-type]
    needs_models = device_bytes is not None or cfg.rollout.kv_cache_gb > 0
    policy = read_config(cfg.policy.path) if needs_models else None
    judge = read_config(cfg.judge.path) if needs_models else None
    trainer = None
    if start is not None:
        trainer = start.state.get("train_backend") or base_trainer(cfg.train, kind, shared).value
    plan = resolve(cfg, hw, policy, judge=judge, judge_max_len=spec.judge_max_len, rollout_max_len=spec.max_len,
                   trainer=trainer)  # fmt: skip
    if plan.too_big and not cfg.train.min_devices:
        raise UserError(f"train.min_devices=auto: {plan.too_big}, or set train.min_devices to run anyway")
    if plan.too_small:
        raise UserError(plan.too_small)
    if note := backend_note(cfg, hw, VLLM_INSTALL):
        logger.warning("%s", note)
    if start is not None and (differs := changed(start.state.get("plan", {}), plan)):
        logger.warning("resumed on devices that resolve the job differently: %s", "; ".join(differs))
    return plan


class _Recorder:
    """What a run does between two batches of events: the finished steps' rows and metrics written (and sent
    to the trackers), a diverged run stopped, and at a step boundary that is due one, a checkpoint written
    before the next commands go out."""

    def __init__(self, cfg: JobConfig, out: str | Path, store: ParameterStore, ctl: Controller, writer: RunWriter,
                 tracker: tracking.Tracker, bar: Any, plan: Plan) -> None:  # fmt: skip
        self.cfg, self.out, self.store, self.ctl, self.plan = cfg, out, store, ctl, plan
        self.writer, self.tracker, self.bar = writer, tracker, bar
        self.written, self.samples_rows = len(ctl.metrics), writer.rows("samples.jsonl")
        self.copied: tuple[int, int] | None = None  # (version, train devices) of a step that copies its state

    def submitted(self, c: Command) -> None:
        if isinstance(c, Step) and c.checkpoint:
            self.copied = (c.version + 1, len(c.devices))

    def after(self) -> None:
        ctl = self.ctl
        self.samples_rows += self.writer.samples(sample_rows(ctl.finished_steps))
        ctl.finished_steps.clear()
        while self.written < len(ctl.metrics):
            m = ctl.metrics[self.written]
            self.writer.step(m)
            self.tracker.step(m)
            self.written += 1
            acc = ctl.accuracy.get(max(ctl.accuracy), 0.0)
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward_mean']:.2f}", acc=f"{acc:.2f}", tok_s=f"{m['tokens_per_s']:.0f}")
            if why := diverged(ctl.metrics[: self.written], self.cfg.train.lr):
                raise TrainingDiverged(why)
        copied = self.copied
        stepped = copied is not None and ctl.version >= copied[0]
        if ctl.checkpoint_due is None and not stepped:
            return
        # before the next commands: this step boundary's state
        copies = shard_copies(self.store, *copied) if stepped and copied is not None else []
        try:
            if ctl.checkpoint_due is not None:
                save_checkpoint(self.cfg, self.out, self.store, ctl, copies, self.written, self.samples_rows,
                                self.plan)  # fmt: skip
        finally:  # written, or not due after all (an older evaluation still ran): the copies go
            ckpt.free(self.store, copies)
        ctl.checkpoint_due, self.copied = None, None if stepped else copied


def _run_once(
    cfg: JobConfig,
    out: str | Path,
    progress: bool,
    ray_address: str | None,
    policy: AllocationPolicy | None,
    in_process: bool | None,
    resume: bool,
) -> dict[str, Any]:
    """One attempt at the job (see :func:`run_job`).

    ``policy`` replaces the one ``cfg.mode`` names (tests, experiments);
    ``in_process`` forces the in-process driver (default: only for one device
    and no Ray address). ``resume`` continues the run in ``out`` from its
    newest usable checkpoint (see :mod:`pivotrl.checkpoint`); ``cfg`` must be
    the run's own.
    """
    from tqdm import tqdm

    start = resumable(cfg, out) if resume else None
    if start is not None:
        cfg = resumed_drill(cfg, start.state["config"])
    for key, backend in (("rollout.backend", cfg.rollout.backend), ("judge.backend", cfg.judge.backend)):
        if backend == "vllm" and not vllm_available():
            raise UserError(f"{key}=vllm: vLLM is not installed here; install it with {VLLM_INSTALL}, or use native")
    tracking.check(cfg.log)
    policy_chat, judge_chat = chat_templates(cfg)
    train_set, heldout = read_task(cfg.task)
    heldout = heldout[: cfg.eval.size]
    check_train_size(cfg, len(train_set))
    origin = time.time()
    if in_process is None:  # (an engine that needs a process of its own has one on Ray: engine_host)
        in_process = cfg.devices == 1 and ray_address is None
        if in_process:
            kind = dev.resolve(cfg.device, dev.local_gpus())
            in_process = engine_processes(cfg.rollout.backend, cfg.judge.backend, kind) == 1
    if in_process and (cfg.fault.device >= 0 or cfg.fault.first):
        raise UserError("fault.device: faults are injected into Ray devices (devices > 1, or --ray-address)")
    if not in_process:
        from pivotrl.runtime.ray_driver import RayDriver

        # the devices' kind is known once the cluster is: the driver builds their spec for it
        def spec_for(kind: str) -> ContextSpec:
            return context_spec(cfg, train_set + heldout, kind, policy_chat, judge_chat)

        if ray_address is None:  # an instance of our own has this machine's devices: a mistake in the job is
            spec_for(dev.resolve(cfg.device, dev.local_gpus()))  # one line before Ray starts

        driver: Any = RayDriver(cfg, spec_for, origin, ray_address)
        store = driver.store
    else:  # devices in this process: they share its cores (and its one GPU, when it has one)
        store = LocalStore()
        spec = TrainSpec(
            cfg.train, cfg.rollout.temperature, collective_timeout_s=collective_timeout(cfg.device_timeout)
        )
        kind = dev.bind(dev.resolve(cfg.device, dev.local_gpus()))
        cspec = context_spec(cfg, train_set + heldout, kind, policy_chat, judge_chat)
        threads = dev.thread_shares(["local"] * cfg.devices, {"local": dev.machine_cores()}, cfg.threads_per_device)
        driver = LocalDriver([Worker(d, store, cspec, spec, origin, threads=threads[d]) for d in range(cfg.devices)])
    try:  # the devices are known: the job is resolved against them once, and so the layout
        kind = kind if in_process else driver.kind
        cspec = cspec if in_process else driver.spec
        devices = None if in_process else driver
        plan = resolve_run(cfg, kind, _device_memory(cfg, kind, devices), cspec, start, bf16=_bf16(kind, devices),
                           vllm=vllm_available() and _on_cuda(kind, devices))  # fmt: skip
        if in_process and plan.tensor_parallel > 1:
            raise UserError(
                f"tensor_parallel={plan.tensor_parallel}: instances of several devices run on Ray (devices > 1, or "
                "--ray-address), each device a process of its own"
            )
        driver.configure(plan)  # (every device takes the plan's train config, dtypes and backends)
        try:
            tp = plan.tensor_parallel  # (the control plane's devices are instances of tp devices)
            policy = policy or make_policy(
                cfg.mode,
                cfg.instances(tp),
                {role: count // tp for role, count in parse_split(cfg.split).items()},
                cfg.rollout.max_batch,
                cfg.rollout.max_new_tokens,
                cfg.judge.max_new_tokens,
                cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                plan.min_train_devices,
            )
        except ValueError as e:
            auto = "" if cfg.train.min_devices else " (train.min_devices=auto found it)"
            raise UserError(f"{e}{auto}") from None
        publish_initial(store, cfg, plan, start)  # (the models are read here: a checkpoint that does not load stops it)
    except BaseException:
        driver.close()
        raise
    tracker = tracking.Tracker()
    try:
        # only once the devices are up and the weights are in the GPS: a failed start leaves no half-written run
        # (a resumed one keeps its rows)
        kept = None if start is None else (start.state["metrics_rows"], start.state["samples_rows"])
        writer = RunWriter(out, keep=kept)
        writer.write_json("config.json", cfg.to_dict())
        tracker = tracking.start(cfg, out, None if start is None else start.step)
        if start is not None:
            driver.groups.state_world = start.state["train_state_world"]  # a sharded trainer reads these shards
        origin = time.time()  # the run clock starts once every device is up and the weights are in the GPS
        driver.start_clock(origin)
        j = cfg.judge
        genrm = GenRM(j.template, j.verdict_pattern, j.rewards, j.fallback_reward, judge_chat)
        clock = lambda: time.time() - origin
        resume_state = None if start is None else start.state["controller"]
        loop = loop_spec(cfg, plan, chat=policy_chat)
        ctl = Controller(loop, policy, genrm, train_set, heldout, clock, resume_state)
        ctl.metrics = writer.read_metrics()  # a resumed run's earlier steps count in its summary
        bar = tqdm(total=cfg.steps, desc=f"train ({cfg.mode}, {cfg.devices} dev)", unit="step", disable=not progress)
        bar.update(ctl.first_step - 1)
        started = clock()
        recorder = _Recorder(cfg, out, store, ctl, writer, tracker, bar, plan)
        try:
            drive(ctl, driver, recorder.after, recorder.submitted)
        except DeviceLostError as e:
            raise RunInterrupted(f"{e}; {resume_hint(out)}") from e
        bar.close()
        wall = clock() - started
        slices = driver.slices()
        gps_memory = store.memory()
        final = store.fetch(POLICY, ctl.version)
        model, tok = build_model(final, torch.device("cpu"), torch.float32)
        save_model(model, tok, Path(out) / "policy")
        copy_chat_template(cfg.policy.path, Path(out) / "policy")  # the trained policy is prompted as the initial one
    except BaseException:
        tracker.close(failed=True)
        raise
    finally:
        driver.close()
    summary = summarize(cfg, ctl, slices, wall)
    if start is not None:
        summary["resumed_from_step"] = start.step
    summary["policy_checkpoint"] = str(Path(out) / "policy")
    summary["gps_bytes"] = gps_memory
    if not in_process:  # Ray's object store as the job configured it (or found it on a cluster)
        summary["object_store"] = driver.object_store.to_dict()
    summary["train_backend"] = plan.trainer.value  # (train.backend=auto's choice for these devices)
    summary["train_min_devices"] = plan.min_train_devices
    summary["plan"] = plan.to_dict()
    tp = plan.tensor_parallel
    shape = f"{cfg.devices} device(s)" + (f" in {cfg.instances(tp)} instances" if tp > 1 else "")
    inst = getattr(driver, "inst", None)  # (the Ray driver's: where instances are of several devices)
    instances = {d: inst.of(d) for d in range(cfg.devices)} if inst is not None and tp > 1 else None
    if instances:
        summary["instances"] = instances  # each device's, as placed (`pivotrl timeline` labels rows with them)
    writer.write_json("summary.json", summary)
    this_run = [m for m in ctl.metrics if m["step"] >= ctl.first_step]  # (earlier attempts ran on other clocks)
    writer.write_events(slices, f"{cfg.mode}, {shape}, {cfg.steps} steps", instances, this_run)
    planner = getattr(policy, "planner", None)
    if planner is not None:  # every decision that moved a device, with the estimate that justified it
        writer.write_jsonl("decisions.jsonl", [d.row() for d in planner.log])
    tracker.finish(summary, Path(out) / "timeline.png")
    logger.info("run written to %s", out)
    return summary
