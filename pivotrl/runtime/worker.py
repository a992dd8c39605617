"""One device: holds a role context and executes the control plane's commands.

The same class runs in-process (local driver) and inside a Ray actor (Ray
driver). Generation is time-sliced: ``run(seconds)`` advances the engine for
about that long and returns what finished, so rewards stream to the judge as
soon as responses end and a shift command never waits long. On Ray a thread
of the device's own calls it slice after slice (``pivotrl.runtime.stream``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

import torch
import torch.distributed as dist

from pivotrl.control.messages import (
    Aborted,
    Accumulate,
    Accumulated,
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
    ShiftDone,
    Step,
    Trained,
)
from pivotrl.engine import SamplingParams, SeqState
from pivotrl.gps import ParameterStore, VersionError
from pivotrl.gps_transfer import PUBLISH
from pivotrl.log import logger
from pivotrl.resolve import Plan
from pivotrl.reward.genrm import judge_prompt
from pivotrl.runtime.contexts import (
    JUDGE,
    POLICY,
    ContextSpec,
    GenerationContext,
    Skeleton,
    TrainContext,
    release_device_memory,
)
from pivotrl.runtime.devices import node_address
from pivotrl.runtime.engine_host import EngineClient, EngineHost, RemoteGeneration, local_client, needs_process
from pivotrl.sample import Sample
from pivotrl.telemetry import Slice
from pivotrl.train.config import TrainConfig
from pivotrl.train.group import DEFAULT_TIMEOUT_S, TrainGroup, listen

Rendezvous = tuple[str, int]  # (host, port) of rank 0's end of a new train group; port 0 for a group of one


class WrongVersionError(RuntimeError):
    """A request for policy version v reached a device holding another version."""


@dataclass(slots=True)
class TrainSpec:
    cfg: TrainConfig
    temperature: float
    keep_versions: int = 2  # policy versions kept in the GPS
    collective_timeout_s: float = DEFAULT_TIMEOUT_S  # a train group's rendezvous and collectives (collective_timeout)


@dataclass(slots=True)
class _Pending:
    """What a request needs back besides the engine state."""

    version: int
    request: GenRequest | JudgeRequest
    prompt_ids: list[int] = field(default_factory=list)


Generation = GenerationContext | RemoteGeneration
EngineProcesses = Callable[[str], EngineClient]  # model -> a client of its engine's own process


class Worker:
    """One device. ``engines`` gives the client of a model's engine in a process of its own (for backends
    that need one: :mod:`pivotrl.runtime.engine_host`); by default the engine is hosted in this process, which
    only a CPU allows (vLLM without sleep mode)."""

    def __init__(
        self,
        device: int,
        store: ParameterStore,
        spec: ContextSpec,
        train: TrainSpec,
        origin: float,
        threads: int = 1,
        engines: EngineProcesses | None = None,
        gpu: int | None = None,
        serves: bool = True,
    ) -> None:
        torch.set_num_threads(threads)
        self.device, self.store, self.spec, self.train_spec, self.origin = device, store, spec, train, origin
        # ``device`` is the control plane's (the instance's) and names the events; ``gpu`` is this device among
        # the job's and names its slices. Of an instance's devices only the first (``serves``) drives the
        # instance's engines; the others follow its roles with no generation context (a rank of the trainer)
        self.gpu = device if gpu is None else gpu
        self.serves = serves
        self.engines = engines or self._in_process
        self.role: Role | None = None
        self.ctx: Generation | TrainContext | None = None
        # generation models released here, to come back to: native skeletons (no memory), clients of engines
        # asleep in their own processes
        self.kept: dict[str, Skeleton | EngineClient] = {}
        self.pending: dict[int, _Pending] = {}
        # migration audit (spec.audit_migrations): a resumed sequence is also generated from scratch, unmigrated,
        # beside it; shadow uid -> real uid, and the tokens of whichever of the two finished first
        self.shadows: dict[int, int] = {}
        self.audit_tokens: dict[int, list[int]] = {}
        self.slices: list[Slice] = []
        self.unheld: list[JudgeRequest] = []  # judgments longer than the judge engine holds, to report
        self.commands_s = 0.0  # time commands that add work took since the last slice (``_command``)
        self._rendezvous: dist.TCPStore | None = None  # rank 0's end of the next step's train group (``listen``)
        # The train group persists across steps (and across shifts out of the train role) until the driver
        # forms another: making a process group costs a rendezvous, and an NCCL one much more.
        self.group: TrainGroup | None = None
        self.group_devices: tuple[int, ...] = ()
        # the optimizer step in progress, as another thread sees it (``progress``, ``abandon``): the driver asks
        # when a step is overdue, to tell the member holding the others from those waiting for it
        self._in_step = False
        self._step_group: TrainGroup | None = None  # its group, once met ...
        self._marks_at_join = 0  # ... and its count of collectives then
        self._abandoned = -1  # the attempt at an optimizer step whose group not to wait for (a member is lost)
        self._attempt = -1  # the attempt of the optimizer step in progress
        self._hang_in_step = False  # fault drill: stop inside the next optimizer step, once its group is met

    def now(self) -> float:
        return time.time() - self.origin

    # -- shifts ---------------------------------------------------------------------
    def configure(self, plan: Plan) -> None:
        """The run's plan, before any context: the train config it made concrete (``train.backend``), and the
        dtypes, backends and migration audit the generation contexts take (``Plan.serving``)."""
        if isinstance(self.ctx, TrainContext):
            raise RuntimeError(f"device {self.device}: its trainer is built already; configure it before the run")
        self.train_spec = replace(self.train_spec, cfg=plan.train)
        self.spec = replace(self.spec, **plan.serving())

    def shift(self, role: Role, version: int) -> ShiftDone:
        """Release the current context, load ``role`` at ``version`` from the GPS."""
        if self.pending or self.unheld:
            raise RuntimeError(f"device {self.device}: shift to {role.value} with sequences in flight")
        self._drop_shadows()
        name, want = (JUDGE, 0) if role is Role.JUDGE else (POLICY, version)
        if want not in self.store.versions(name):  # check before releasing anything: a refused shift changes nothing
            have = self.store.versions(name)
            raise VersionError(f"device {self.device}: {name} has no weights version {want} (available: {have})")
        t0 = self.now()
        before = self.role
        engine: dict[str, Any] = {}
        if role is self.role and role is Role.ROLLOUT and _generating(self.ctx):
            nbytes = self.ctx.refresh(self.store, version)  # same model, new weights: keep engine and cache
        elif role is self.role and role is Role.JUDGE:
            nbytes = 0
        else:
            self._release()
            if role in (Role.ROLLOUT, Role.JUDGE) and not self.serves:
                self.ctx = None  # (the instance's first device serves it, on this device's GPU too)
            elif role in (Role.ROLLOUT, Role.JUDGE):
                self.ctx = self._generation(name, want)
                if isinstance(self.ctx, RemoteGeneration):  # which process serves it, and what it built
                    builds = ",".join(self.ctx.builds)
                    engine = {"engine_pid": self.ctx.pid, "engine_builds": builds, "device_pid": os.getpid()}
            else:
                train = self.train_spec
                self.ctx = TrainContext(
                    version, self.store, self.spec, train.cfg, train.temperature, train.keep_versions
                )
            nbytes = 0 if self.ctx is None else self.ctx.nbytes
        if isinstance(self.ctx, RemoteGeneration) and self.ctx.engine.ranks > 1:  # (what each rank holds of it)
            engine["rank_bytes"] = self.ctx.rank_bytes
        self.role = role
        t1 = self.now()
        name = f"{before.value if before else 'none'}->{role.value}"
        measured = {"bytes": nbytes, "version": version, **engine}
        self.slices.append(Slice(self.gpu, "shift", name, t0, t1, measured))
        logger.debug("device %d: shift %s v%d, %d bytes in %.3f s", self.device, name, version, nbytes, t1 - t0)
        return ShiftDone(self.device, role, version, t1 - t0, nbytes)

    def _generation(self, name: str, version: int) -> Generation:
        """Wake model ``name`` at ``version``: from what it left here, or in its engine's own process."""
        kept = self.kept.pop(name, None)
        if needs_process(self.spec.backend(name)):
            client = kept if isinstance(kept, EngineClient) else self.engines(name)
            return RemoteGeneration(name, version, client)
        return GenerationContext(name, version, self.store, self.spec, kept)

    def _in_process(self, name: str) -> EngineClient:
        if torch.device(self.spec.device).type == "cuda":
            raise RuntimeError(
                f"device {self.device}: the {self.spec.backend(name)} engine of {name} needs a process of its own on "
                "a GPU (one sleep-mode allocator per process); this worker was given none (run it on Ray)"
            )
        return local_client(EngineHost(name, self.store, self.spec, torch.get_num_threads()))

    def _release(self) -> None:
        """Leave the current role: its context frees its device memory (a generation context leaves its
        skeleton behind; sharded train state goes to the GPS first), then torch's cached blocks go back to
        the device, here and nowhere else."""
        if self.ctx is None:
            return
        if _generating(self.ctx):
            self.kept[self.ctx.name] = self.ctx.release()
        else:
            self._save_state(self.ctx)  # sharded train state leaves the device through the GPS
            self.ctx.release()
            PUBLISH.release()  # (the host buffer its publishes packed into: as large as a version, page-locked)
        self.ctx, self.role = None, None
        release_device_memory(self.spec.device)

    # -- generation -----------------------------------------------------------------
    def generate(self, cmd: Generate) -> None:
        with self._command():
            self._generate(cmd)

    def judge(self, cmd: Judge) -> None:
        with self._command():
            self._judge(cmd)

    @contextlib.contextmanager
    def _command(self) -> Iterator[None]:
        """Time a command that adds work between two slices of generation: the next slice reports it
        (``commands_s``), so the gap before it is not taken for waiting."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.commands_s += time.perf_counter() - t0

    def _generate(self, cmd: Generate) -> None:
        ctx = self._generation_ctx(Role.ROLLOUT)
        if ctx.version != cmd.version:
            raise WrongVersionError(f"device {self.device} holds policy v{ctx.version}, requests need v{cmd.version}")
        stop = tuple(ctx.tokenizer.eos_token_ids)
        special = self.spec.adds_special_tokens(POLICY)
        for r in cmd.requests:
            prompt_ids = r.prompt_ids or ctx.tokenizer.encode(r.prompt, add_special_tokens=special)
            state = SeqState(r.uid, prompt_ids, r.seed, _sampling(r.params, stop), list(r.output_ids), list(r.logprobs))
            ctx.engine.add(state)
            self.pending[r.uid] = _Pending(ctx.version, r, prompt_ids)
            # (the audit's copy writes every token with this version: a partial rollout's older tokens would differ)
            if r.output_ids and self.spec.audit_migrations and r.prefix_version in (-1, ctx.version):
                shadow = _shadow_uid(r.uid)
                ctx.engine.add(SeqState(shadow, prompt_ids, r.seed, state.params))
                self.shadows[shadow] = r.uid

    def _judge(self, cmd: Judge) -> None:
        ctx = self._generation_ctx(Role.JUDGE)
        stop = tuple(ctx.tokenizer.eos_token_ids)
        spec = self.spec
        for r in cmd.requests:
            ids = list(r.prompt_ids)
            if not ids:
                text = judge_prompt(spec.judge_template, r.question, r.reference, r.response, spec.judge_chat)
                ids = ctx.tokenizer.encode(text, add_special_tokens=spec.adds_special_tokens(JUDGE))
            need = len(ids) + r.params.max_new_tokens
            if need > ctx.engine.max_len and not ctx.engine.has_work:
                with contextlib.suppress(ValueError):  # (an engine that cannot grow: vLLM's length limit is fixed)
                    ctx.engine.ensure_capacity(need)
            if need > ctx.engine.max_len:  # a judgment that cannot be held: unparsable, counted, never fatal
                logger.warning(
                    "device %d: judge prompt of request %d (%d tokens) + %d new exceeds the judge engine's length "
                    "limit %d; it is counted unparsable", self.device, r.uid, len(ids), r.params.max_new_tokens,
                    ctx.engine.max_len,
                )  # fmt: skip
                self.unheld.append(r)
                continue
            ctx.engine.add(SeqState(r.uid, ids, r.seed, _sampling(r.params, stop), list(r.output_ids)))
            self.pending[r.uid] = _Pending(0, r, ids)

    def abort(self, uids: tuple[int, ...] = ()) -> Aborted:
        """Stop the requests of ``uids`` still in flight (everything, when empty); they come back
        with their tokens so far."""
        with self._command():
            return self._abort(uids)

    def _abort(self, uids: tuple[int, ...]) -> Aborted:
        t0 = self.now()
        gen: list[GenRequest] = []
        judge: list[JudgeRequest] = []
        if _generating(self.ctx):
            engine = self.ctx.engine
            self._drop_shadows(uids)
            states = [engine.abort(u) for u in uids if u in self.pending] if uids else engine.abort_all()
            for state in states:
                p = self.pending.pop(state.uid)
                if isinstance(p.request, GenRequest):
                    r = p.request
                    gen.append(
                        GenRequest(r.uid, r.prompt, r.seed, r.params, p.prompt_ids, state.output_ids, state.logprobs)
                    )
                else:  # a judgment resumes too (same seed, same tokens)
                    judge.append(replace(p.request, prompt_ids=tuple(p.prompt_ids), output_ids=tuple(state.output_ids)))
        kept = [r for r in self.unheld if uids and r.uid not in uids]  # (a judgment not held goes with the rest)
        judge += [r for r in self.unheld if r not in kept]
        self.unheld = kept
        assert uids or not self.pending, "requests in flight outside the engine"
        t1 = self.now()
        if gen or judge:
            role = self.role.value if self.role else "idle"
            self.slices.append(Slice(self.gpu, "migrate", f"abort {len(gen) + len(judge)} {role}", t0, t1))
        return Aborted(self.device, tuple(gen), tuple(judge), t1 - t0)

    @property
    def has_work(self) -> bool:
        """Sequences in flight: requests, and the audit's unmigrated copies (which a shift drops); judgments
        that could not be held, to report."""
        return bool(self.pending or self.shadows or self.unheld)

    def _drop_shadows(self, uids: tuple[int, ...] = ()) -> None:
        """Stop the audit's copies of the requests ``uids`` (all, when empty: a shift, an abort of everything)
        that still run here: their requests leave, so they go unchecked."""
        drop = [s for s, uid in self.shadows.items() if not uids or uid in uids]
        for shadow in drop:
            if _generating(self.ctx):
                self.ctx.engine.abort(shadow)
            self.audit_tokens.pop(self.shadows.pop(shadow), None)
        waiting = [uid for uid in self.audit_tokens if not uids or uid in uids]  # copies done, requests leaving
        for uid in waiting:
            del self.audit_tokens[uid]
        if drop or waiting:
            self._audit_slice(0, 0, len(drop) + len(waiting))

    def _audit(self, finished: list[SeqState]) -> list[SeqState]:
        """Pair each finished sequence with its unmigrated copy; returns the requests' sequences only."""
        real = []
        checked = identical = 0
        for s in finished:
            if s.uid in self.shadows:  # a copy: its request's uid
                uid = self.shadows.pop(s.uid)
            else:
                uid = s.uid
                real.append(s)
                if _shadow_uid(uid) not in self.shadows and uid not in self.audit_tokens:
                    continue  # not audited
            other = self.audit_tokens.pop(uid, None)
            if other is None:
                self.audit_tokens[uid] = list(s.output_ids)
            else:
                checked += 1
                identical += other == s.output_ids
        if checked:
            self._audit_slice(checked, identical, 0)
        return real

    def _audit_slice(self, checked: int, identical: int, dropped: int) -> None:
        t = self.now()
        measured = {"checked": checked, "identical": identical, "dropped": dropped}
        self.slices.append(Slice(self.gpu, "audit", f"audit {identical}/{checked}", t, t, measured))

    def run(self, seconds: float) -> list[Event]:
        """Advance the engine by at least one step and for about ``seconds``: a
        ``Progress`` event, and what finished (``Generated`` or ``Judged``)."""
        ctx = self.ctx
        if not self.has_work or not _generating(ctx) or self.role is None:
            return []
        if self.unheld:  # (reported before the engine runs: nothing of them is in it)
            unheld = tuple(JudgeResult(r.uid, "", False, 0) for r in self.unheld)
            self.unheld = []
            if not self.pending and not self.shadows:
                return [Judged(self.device, unheld)]
            events = self.run(seconds)
            return [*events, Judged(self.device, unheld)]
        t0 = self.now()
        report = ctx.engine.run(seconds, self.now)
        t1 = self.now()
        role, finished = self.role, report.finished
        if self.shadows or self.audit_tokens:
            finished = self._audit(finished)
        measured = {
            "tokens": report.tokens, "running": report.running, "finished": len(finished), "steps": report.steps,
            "kv": report.kv,
        }  # fmt: skip
        if report.prefill_tokens:
            measured |= {"prefill_tokens": report.prefill_tokens, "prefill_s": round(report.prefill_s, 6)}
        if self.commands_s:  # (what commands took since the last slice: device time between the two, not waiting)
            measured["commands_s"] = round(self.commands_s, 6)
            self.commands_s = 0.0
        progress = tuple(p for p in report.progress if p[0] not in self.shadows)  # (the audit's copies are ours)
        events: list[Event] = [
            Progress(
                self.device,
                role,
                t1 - t0,
                report.tokens,
                report.running,
                progress,
                report.prefill_tokens,
                report.prefill_s,
                report.steps,
                report.kv,
            )
        ]
        if role is Role.ROLLOUT and finished:
            results = []
            for s in finished:
                p = self.pending.pop(s.uid)
                text = ctx.tokenizer.decode(s.output_ids)
                results.append(
                    GenResult(s.uid, p.prompt_ids, s.output_ids, s.logprobs, text, s.finish_reason or "", p.version)
                )
            events.append(Generated(self.device, tuple(results)))
        elif finished:
            out = []
            for s in finished:
                self.pending.pop(s.uid)
                text = ctx.tokenizer.decode(s.output_ids)
                out.append(JudgeResult(s.uid, text, s.finish_reason == "length", len(s.output_ids)))
            events.append(Judged(self.device, tuple(out)))
        # (the slice spans the results' decoding too: the device's time, not a gap; Progress times the engine)
        name = f"{role.value} {len(finished)} done"
        self.slices.append(Slice(self.gpu, role.value, name, t0, self.now(), measured))
        return events

    def _generation_ctx(self, role: Role) -> Generation:
        if self.role is not role or not _generating(self.ctx):
            have = self.role.value if self.role else "no role"
            raise RuntimeError(f"device {self.device} holds {have}, cannot serve {role.value} requests")
        return self.ctx

    # -- training -------------------------------------------------------------------
    def accumulate(self, cmd: Accumulate) -> Accumulated:
        """Backward of some judged groups; gradients add up until the step."""
        ctx = self._train_ctx(cmd.version)
        t0 = self.now()
        shard = cmd.shard
        samples = [
            Sample(i, 0, "", "", list(p), 0, response_ids=list(r), logprobs=list(lp))
            for i, (p, r, lp) in enumerate(zip(shard.prompt_ids, shard.response_ids, shard.logprobs, strict=True))
        ]
        trainer = ctx.trainer
        stats = trainer.accumulate(samples, list(shard.advantages))
        if trainer.traits.lockstep:  # kept: the whole group backpropagates it at the step
            return Accumulated(self.device, len(samples), 0, self.now() - t0)
        t1 = self.now()
        tokens = int(stats.get("tokens", 0))
        self.slices.append(
            Slice(
                self.device, "train", f"accumulate {len(samples)}", t0, t1, {"samples": len(samples), "tokens": tokens}
            )
        )
        # the span logs the tokens the loss saw (responses); the planner prices whole sequences
        processed = sum(len(p) + len(r) for p, r in zip(shard.prompt_ids, shard.response_ids, strict=True))
        return Accumulated(self.device, len(samples), processed, t1 - t0)

    def listen(self, world_size: int) -> Rendezvous:
        """Open rank 0's end of the next step's train group of ``world_size`` devices: its node's address
        and the port it holds, for the others."""
        host = node_address()
        self._rendezvous = listen(world_size, master_addr=host)
        return host, self._rendezvous.port

    def retire_group(self) -> None:
        """The driver forms a new train group: write this device's sharded train state to the GPS (the new
        group reads it there) and leave the old process group. A no-op for a device that holds neither."""
        if isinstance(self.ctx, TrainContext):
            self._save_state(self.ctx)
            self.ctx.trainer.leave()
        self.close()
        # (an FSDP2 model and its state hold each other: without the collector the old group's shards would stay
        # on the GPU beside the new group's, 16 / W_old + 16 / W_new bytes a parameter at the next step)
        release_device_memory(self.spec.device)

    def close(self) -> None:
        """Leave the train group, if any (end of the run)."""
        if self.group is not None:
            self.group.leave()
        self.group, self.group_devices = None, ()

    def _save_state(self, ctx: TrainContext) -> None:
        t0 = self.now()
        nbytes = ctx.trainer.save_state()
        if nbytes is not None:
            self.slices.append(Slice(self.gpu, "shift", "train state -> GPS", t0, self.now(), {"bytes": nbytes}))

    def progress(self) -> int:
        """How far this device is in the optimizer step it runs (safe to call from another thread): -1 in
        none, 0 while it meets its group, then one more for each collective it has entered. The members of a
        step count alike; one that stopped short of a collective the others wait in counts fewer."""
        if not self._in_step:
            return -1
        group = self._step_group
        return 0 if group is None else 1 + group.marks - self._marks_at_join

    def hang_in_next_step(self) -> None:
        """Fault drill (``fault.kind=hang``, ``fault.phase=optimizer``): stop answering inside the next optimizer
        step, after meeting its group and before its first collective, as a device whose kernel hangs there."""
        self._hang_in_step = True

    def abandon(self, attempt: int) -> None:
        """Give up meeting the train group of optimizer step ``attempt`` (another thread calls this, maybe before
        the step starts: a member is lost and will not come); a step past its rendezvous has its group's
        communicator aborted, so that the collective it waits in with the lost member fails now (NCCL would wait
        for its timeout; gloo fails as the lost member's connections close)."""
        self._abandoned = attempt
        group = self._step_group
        if self._in_step and self._attempt == attempt and group is not None:
            group.abort()

    def _join(
        self, cmd: Step, rank: int, rendezvous: Rendezvous | None, process_group: bool, attempt: int
    ) -> TrainGroup:
        """The step's train group: the one held (``rendezvous`` None) or a new one met at ``rendezvous``."""
        if rendezvous is None:
            if self.group is None or self.group_devices != cmd.devices or self.group.rank != rank:
                raise RuntimeError(
                    f"device {self.device}: told to keep train group {cmd.devices} as rank {rank}, "
                    f"but it holds {self.group_devices or 'none'}"
                )
            return self._met(self.group)
        if self.group is not None:
            self.group.leave()
        host, port = rendezvous
        store, self._rendezvous = (self._rendezvous, None) if rank == 0 and len(cmd.devices) > 1 else (None, None)
        # rank 0 called listen() before the port was handed out: a refused connection means it is gone
        self.group = TrainGroup.join(
            rank, len(cmd.devices), host, port, device=self.spec.device, store=store, process_group=process_group,
            listening=True, abandon=lambda: self._abandoned == attempt, staged=self.spec.shared_gpu,
            timeout_s=self.train_spec.collective_timeout_s,
        )  # fmt: skip
        self.group_devices = cmd.devices
        return self._met(self.group)

    def _met(self, group: TrainGroup) -> TrainGroup:
        self._marks_at_join, self._step_group = group.marks, group
        return group

    def step(
        self, cmd: Step, rank: int, rendezvous: Rendezvous | None, state_world: int = 0, attempt: int = 0
    ) -> Trained | None:
        """This device's part of the optimizer step; rank 0 publishes the new version.

        ``rendezvous`` None keeps the train group this device holds for
        ``cmd.devices``; otherwise a new group is met there (rank 0 of a group
        of several devices has called ``listen`` first). ``state_world`` is the
        size of the group that wrote the sharded train state of ``cmd.version``
        to the GPS (0: none yet; a sharded trainer starts from the weights).
        ``attempt`` numbers the driver's optimizer steps (a failed one is tried
        again under a new number): ``abandon(attempt)`` names the one whose
        group this device no longer waits for.
        """
        ctx = self._train_ctx(cmd.version)
        self._step_group, self._in_step, self._attempt = None, True, attempt
        try:
            return self._step(ctx, cmd, rank, rendezvous, state_world, attempt)
        except BaseException as e:
            # a member that fails out of a collective (a member lost) leaves the group at once, its connections
            # closed: the others that wait for it fail too, instead of at their timeout or when the driver kills
            # them (TrainGroup.leave_after)
            if self.group is not None:
                self.group.leave_after(e)
            self.close()
            raise
        finally:
            self._in_step, self._step_group = False, None

    def _step(
        self, ctx: TrainContext, cmd: Step, rank: int, rendezvous: Rendezvous | None, state_world: int, attempt: int
    ) -> Trained | None:
        t0 = self.now()
        trainer = ctx.trainer
        group = self._join(cmd, rank, rendezvous, trainer.traits.always_grouped, attempt)
        if self._hang_in_step:
            self._hang_in_step = False
            while True:  # (the driver kills this process when its step is overdue)
                time.sleep(3600)
        trainer.join(group, state_world)
        result = trainer.step(cmd.total_tokens)
        group.check_intact()  # (an aborted collective may have returned part way: such an update is not published)
        trainer.publish(cmd.checkpoint)
        assert trainer.version == cmd.version + 1
        t1 = self.now()
        self.slices.append(Slice(self.gpu, "train", f"step v{cmd.version}->v{trainer.version}", t0, t1))
        if rank != 0:
            return None
        return Trained(cmd.devices, trainer.version, result.stats, t1 - t0, result.tokens, result.backward_s)

    def _train_ctx(self, version: int) -> TrainContext:
        ctx = self.ctx
        if not isinstance(ctx, TrainContext):
            raise RuntimeError(f"device {self.device} is not in the train role")
        if ctx.version != version:
            raise WrongVersionError(f"device {self.device} holds policy v{ctx.version}, update needs v{version}")
        return ctx

    def drain_slices(self) -> list[Slice]:
        out, self.slices = self.slices, []
        return out


def _generating(ctx: object) -> TypeGuard[Generation]:
    return isinstance(ctx, GenerationContext | RemoteGeneration)


def _shadow_uid(uid: int) -> int:
    """The audit copy's uid: negative, never a request's."""
    return -1 - uid


def _sampling(p: GenParams, stop: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(p.max_new_tokens, p.temperature, p.top_p, p.top_k, stop)
