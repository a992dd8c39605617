"""The RL step loop as an event-driven state machine.

What waits for what (on-policy GRPO):

    rollout of step k  -- needs -->  policy weights of version k-1 on the device
    judging a response -- needs -->  that response finished (streamed, one by one)
    the update of step k -- needs --> every reward of step k
    rollout of step k+1 -- needs --> the update of step k (version k) published

Evaluation of version k runs as greedy generation requests next to the
rollout of step k+1 (same weights), and its accuracy is reported with step k.

The controller only reacts: ``start()`` and ``handle(event)`` return the
commands to send. Which device holds which role is decided by the allocation
policy; the scheduler hands queued requests to devices holding the role.
"""

from __future__ import annotations

import bisect
import itertools
import random
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from pivotrl.control.messages import (
    Abort,
    Aborted,
    Accumulate,
    Accumulated,
    Command,
    DeviceJoined,
    DeviceLost,
    Event,
    Generated,
    GenParams,
    GenRequest,
    Judged,
    JudgeRequest,
    Progress,
    Role,
    Shift,
    ShiftDone,
    Step,
    StepFailed,
    Trained,
    TrainShard,
)
from pivotrl.control.modes import AllocationPolicy, Demand
from pivotrl.control.profiles import Workload
from pivotrl.control.scheduler import Scheduler
from pivotrl.control.shiftable import PlanView
from pivotrl.reward.genrm import GenRM, JudgeStats
from pivotrl.sample import Problem, Sample, Status
from pivotrl.train.advantages import group_advantages

EVAL_UID = 1 << 40  # evaluation requests live above this uid ...
EVAL_STRIDE = 1 << 24  # ... in one block per evaluation, so two evaluations in flight never mix
# an optimizer step that fails this many times in a row stops this attempt at the run (the job then resumes from
# its newest checkpoint on devices started afresh): a step whose devices cannot meet must not be retried for ever
UPDATE_ATTEMPTS = 3


def sequence_seed(job_seed: int, step: int, uid: int) -> int:
    """Sampling seed of one sequence: fixed by (job seed, step, sample), not by placement."""
    return ((job_seed * 1_000_003 + step) * 1_048_583 + uid) % (1 << 62)


@dataclass(slots=True, frozen=True)
class LoopSpec:
    """The parts of the job config the loop needs: plain values, and two functions: the task's answer checker
    (``check``, task.checker; its libraries stay out of the control plane) and the policy's chat template
    (``chat``; the job reads it from the checkpoint, so the loop needs no template engine)."""

    seed: int
    steps: int
    prompts_per_step: int
    group_size: int
    prompt_template: str
    rollout: GenParams
    judge: GenParams
    eval_params: GenParams
    eval_every: int
    scale_by_std: bool
    per_device: int  # requests in flight per device
    # the task's answer checker (response text, reference) -> correct: measures accuracy, never rewards
    check: Callable[[str, str], bool]
    judge_per_device: int = 0  # judgments in flight per device (0: per_device)
    judge_kv: int = 0  # tokens of paged KV cache a judge device holds: its judgments' reads at most (0: no limit)
    rebalance: bool = True  # even out the sequences in flight over the rollout devices once none is queued
    sharded_train: bool = False  # the trainer shards its state over the train devices (one lost loses the state)
    # the trainer backpropagates every group at the optimizer step, in lockstep over its devices (FSDP2): a group
    # handed to a train device before is only buffered there, and no backward overlaps the rollout or the judge
    lockstep_train: bool = False
    # the fewest train devices the optimizer step runs on (train.min_devices): where one cannot hold the
    # trainer's state, the step waits for as many as hold it (at most every device not lost)
    min_train_devices: int = 1
    checkpoint_every: int = 0  # a checkpoint after every this many steps (0: none); see ``Controller.checkpoint``
    # the policy's chat template (task.chat_template) as a function of the formatted prompt; None: none
    chat: Callable[[str], str] | None = None


@dataclass(slots=True)
class DeviceView:
    id: int
    role: Role | None = None
    version: int = -1
    shifting: bool = False
    training: bool = False  # in the optimizer step
    aborting: bool = False  # an Abort in flight
    leaving: Role | None = None  # aborted to take this role: it shifts there next, whatever the plan says by then
    heading: Role | None = None  # the role of the shift in flight
    accumulating: int = 0  # samples of the Accumulate in flight (0: none)
    grads: bool = False  # holds gradients of this step: stays in the train role until the step
    held: list[int] = field(default_factory=list)  # samples (indexes) handed to its backward this step
    lost: bool = False  # died or hung; out of every role until it joins again
    # holds its shard of a sharded train state, which nothing else holds: it stepped in the last optimizer step
    # and has not shifted since (a shift writes the shard to the GPS first)
    shard: bool = False


@dataclass(slots=True)
class StepRecord:
    step: int
    samples: list[Sample]
    started: float
    judge_stats: JudgeStats = field(default_factory=JudgeStats)
    judged: int = 0
    train_stats: dict[str, float] = field(default_factory=dict)
    finished: float | None = None
    shifts: int = 0
    shift_seconds: float = 0.0
    judge_tokens: int = 0
    judge_prefill_tokens: int = 0  # tokens the judge devices read: prompts, templates, preempted judgments again
    migrations: int = 0
    recovered: int = 0  # sequences and judgments begun again, and samples backpropagated again, after a lost device
    generated: int = 0
    group_judged: dict[int, int] = field(default_factory=dict)  # prompt index -> judged members
    group_generated: dict[int, int] = field(default_factory=dict)  # prompt index -> generated members
    group_whole_at: dict[int, float] = field(default_factory=dict)  # prompt index -> when its last member ended
    group_waits: list[float] = field(default_factory=list)  # per group judged: seconds from whole to judged whole
    groups_judged_at_rollout_end: int = 0  # groups whose backward could start when the rollout ended
    accumulated: int = 0  # samples whose backward is done
    backward: set[int] = field(default_factory=set)  # samples handed to a backward (indexes into samples)
    advantages: dict[int, float] = field(default_factory=dict)  # sample index -> advantage, once its group is judged
    rollout_end: float | None = None
    first_judged: float | None = None
    judge_end: float | None = None
    train_start: float | None = None


class DeviceLostError(RuntimeError):
    """A device was lost holding state nothing else holds (its shard of a sharded train state), or the optimizer
    step failed ``UPDATE_ATTEMPTS`` times in a row: this attempt at the run cannot go on; the job resumes from its
    newest checkpoint."""


class Controller:
    def __init__(
        self,
        spec: LoopSpec,
        policy: AllocationPolicy,
        genrm: GenRM,
        train_set: list[Problem],
        heldout: list[Problem],
        clock: Callable[[], float],
        resume: dict[str, Any] | None = None,
    ) -> None:
        self.spec, self.policy, self.genrm, self.clock = spec, policy, genrm, clock
        self.train_set, self.heldout = train_set, heldout
        self.devices = [DeviceView(i) for i in range(policy.devices)]
        self.scheduler = Scheduler(
            spec.per_device, spec.judge_per_device or None, self._judge_weight, spec.judge_kv or None
        )
        self.version = 0
        self.step: StepRecord | None = None
        self.by_uid: dict[int, Sample] = {}
        self.train_ready = self.training = False  # every reward in / optimizer step running
        self.train_queue: deque[int] = deque()  # samples of judged groups waiting for their backward
        self.eval_hits: dict[int, dict[int, bool]] = {}  # step evaluated after -> held-out index -> correct
        self.accuracy: dict[int, float] = {}  # step -> held-out accuracy after it
        self.pending_metrics: dict[int, dict[str, Any]] = {}  # finished steps waiting for their evaluation
        self.metrics: list[dict[str, Any]] = []  # finished steps, in order
        self.finished_steps: list[StepRecord] = []  # finished steps' records, for the run's samples.jsonl; drained
        self.shift_log: list[ShiftDone] = []
        self.tokens_so_far: dict[int, int] = {}  # uid -> tokens running sequences have written (responses, verdicts)
        self._rebalance_due = False  # the rollout devices' loads changed since they were last compared
        self._handlers: dict[type, Callable[[Any], None]] = {
            ShiftDone: self._on_shift, Generated: self._on_generated, Judged: self._on_judged,
            Trained: self._on_trained, Aborted: self._on_aborted, Accumulated: self._on_accumulated,
            Progress: self._on_progress, DeviceLost: self._on_lost, DeviceJoined: self._on_joined,
            StepFailed: self._on_step_failed,
        }  # fmt: skip
        self._holders: dict[Role, set[int]] = {role: set() for role in Role}  # the devices holding each role
        self._pick_role: dict[Role, Callable[[tuple[int, ...]], Iterable[int]]] = {}  # see _role_load
        # the pump's memory (see ``pump``): devices that had an event or a command since it last looked,
        # the targets and policy version it last looked with (and the devices each role is to have then),
        # and the devices ready for more work in each role
        self._touched: set[int] = set()
        self._looked: tuple[dict[int, Role] | None, int] = (None, -1)
        self._wanted: Counter[Role] = Counter()
        self._ready: dict[Role | None, set[int]] = {role: set() for role in (*Role, None)}
        self.measured = {  # running means (priors until measured)
            "judge_tokens": float(spec.judge.max_new_tokens) / 2,
            "response_tokens": float(spec.rollout.max_new_tokens) / 2,
            "prompt_tokens": 16.0,
            "step_seconds": 0.1,
            "judge_reread": 1.0,
        }
        # tokens and judgments seen until the first step is trained (None from then on)
        self._first_judgments: list[int] | None = [0, 0]
        # the last step's judgment lengths, sorted, and the sums of each suffix (what a running judgment
        # has still to write is judged by them: a judge that reasons writes lengths of a long tail)
        self._judgments: tuple[list[int], list[int]] = ([], [0])
        self.lost_log: list[tuple[float, int, str]] = []  # (when, device, why) of every device lost
        self.failed_updates = 0  # optimizer steps failed in a row (since the last update)
        self.done = False
        self.top_reward = max(genrm.rewards.values())
        self.first_step = 1  # the step this run starts at (later when it resumes a checkpoint)
        self.checkpoint_due: int | None = None  # a finished step whose checkpoint the driver is to write now
        self._resume_evals: list[int] = []
        if resume is not None:
            self._restore(resume)

    # -- the loop -------------------------------------------------------------------
    def start(self) -> list[Command]:
        if self.first_step == 1:
            self._begin_eval(0)
        for after in self._resume_evals:  # the evaluation that was running when the checkpoint was written
            self._begin_eval(after)
        self._begin_step(self.first_step)
        return self.pump()

    # -- checkpoints ----------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """What resuming after the step just finished needs (plain values; see ``checkpoint_due``).

        Samples depend only on (seed, step, sample) and the weights, so the
        step loop resumes exactly from its position: the version, the
        evaluation of that version if one was running, the steps' metrics
        waiting for it, and the held-out accuracies so far. The running means
        feed planning only; they are kept so the resumed run plans as the
        uninterrupted one would.
        """
        assert self.checkpoint_due is not None
        return {
            "step": self.checkpoint_due,
            "version": self.version,
            "evaluating": sorted(self.eval_hits),
            "pending_metrics": {str(k): v for k, v in self.pending_metrics.items()},
            "accuracy": {str(k): v for k, v in self.accuracy.items()},
            "measured": dict(self.measured),
            "judgments": self._judgments[0],
            "planner": self.policy.state() if hasattr(self.policy, "state") else None,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        step, version = int(state["step"]), int(state["version"])
        if step >= self.spec.steps:
            raise ValueError(f"the checkpoint is of step {step}, the last of {self.spec.steps}: nothing to resume")
        self.first_step, self.version = step + 1, version
        for d in self.devices:
            d.version = -1
        self._resume_evals = [int(k) for k in state["evaluating"]]
        self.pending_metrics = {int(k): v for k, v in state["pending_metrics"].items()}
        self.accuracy = {int(k): float(v) for k, v in state["accuracy"].items()}
        self.measured.update(state["measured"])
        if state.get("planner") is not None and hasattr(self.policy, "restore"):
            self.policy.restore(state["planner"])
        lengths = sorted(int(x) for x in state["judgments"])
        self._judgments = (lengths, list(itertools.accumulate(reversed(lengths), initial=0))[::-1])
        self._first_judgments = None

    def handle(self, event: Event) -> list[Command]:
        self._apply(event)
        return self.pump()

    def handle_all(self, events: list[Event]) -> list[Command]:
        """Several events that arrived together, then one pump: what a driver that
        collects many completions at once (a cluster, the simulator) should call."""
        for event in events:
            self._apply(event)
        return self.pump()

    def _apply(self, event: Event) -> None:
        kind = type(event)  # (a table, not a chain of isinstance: progress reports are half of a run's events)
        handler = self._handlers.get(kind)
        if handler is None:
            raise TypeError(f"unknown event {event!r}")
        if kind is Trained or kind is StepFailed:
            self._touched.update(event.devices)
        elif kind is not Progress:  # (a progress report changes no device's state)
            self._touched.add(event.device)
        previous = self.devices[event.device].role if kind is ShiftDone else None  # (StepFailed: no .device)
        self.policy.observe(event, previous)
        if kind is not Progress:
            self._measure(event)
        handler(event)

    def pump(self) -> list[Command]:
        """Commands that the current state allows: shifts towards the policy's
        targets, queued requests to devices holding their role, the update."""
        if self.done:
            return []
        cmds: list[Command] = []
        demand = self.demand()
        targets, loads = self.policy.targets(demand), demand.loads
        # each device shifts (or aborts its work) towards its target, or, holding the rollout or judge
        # role and staying, is ready for more of its work (below). What a device does follows from its
        # state, its load, its target and the policy version: with the same targets and version as the
        # last pump, only the devices that had an event or a command since can do something else
        # (a thousand devices, thousands of pumps a run, most of them after progress reports)
        version, preempt, rollout, genrm = self.version, self.policy.preempt, Role.ROLLOUT, Role.JUDGE
        if targets != self._looked[0] or version != self._looked[1]:
            visit: Iterable[int] = range(len(self.devices))
            self._looked = (dict(targets), version)
            self._wanted = Counter(r for i, r in targets.items() if not self.devices[i].lost)  # each role is to have
        else:
            visit = sorted(self._touched)
        self._touched = set()
        devices, ready_sets = self.devices, self._ready.values()
        for i in visit:
            d = devices[i]
            for ready in ready_sets:  # (looked at again: ready for its role's work below, or not)
                ready.discard(i)
            if d.shifting or d.training or d.aborting or d.accumulating or d.grads or d.lost:
                continue
            leaving = d.leaving
            want = targets[i] if leaving is None else leaving
            if loads[i]:
                if d.role is not want and preempt:  # leave now: its requests migrate
                    cmds.append(Abort(i))
                    d.aborting, d.leaving = True, want  # a decision acted on is kept: no work comes back to it
                elif leaving is None and (d.role is not rollout or d.version == version):
                    self._ready[d.role].add(i)  # (a stale rollout device finishes its work, takes no more)
                continue
            d.leaving = None
            if d.role is not want or (want is not genrm and d.version != version):  # or stale
                cmds.append(Shift(i, want, version))
                d.shifting, d.heading = True, want
            else:  # a rollout device's version is current: it would be shifting
                self._ready[d.role].add(i)
        cmds += self._dispatch()
        for c in cmds:  # whoever got a command is looked at again next time
            if isinstance(c, Step):
                self._touched.update(c.devices)
            else:
                self._touched.add(c.device)
        return cmds

    def _dispatch(self) -> list[Command]:
        """Queued requests to the devices ready for them, the rollout rebalanced, the train work."""
        cmds: list[Command] = []
        s = self.scheduler
        if s.gen_queue or s.judge_queue:
            wanted = self._wanted
            for role, queue in ((Role.ROLLOUT, s.gen_queue), (Role.JUDGE, s.judge_queue)):
                if not queue:
                    continue
                ready = sorted(self._ready[role])
                joining = max(0, wanted[role] - len(ready))
                if role is Role.ROLLOUT:
                    sent = s.dispatch_gen(ready, self.version, joining)
                    self._rebalance_due |= bool(sent)
                    cmds += sent
                else:
                    cmds += s.dispatch_judge(ready, joining)
        if self.spec.rebalance and self._rebalance_due and not s.gen_queue:
            cmds += self._rebalance(sorted(self._ready[Role.ROLLOUT]))
        cmds += self._dispatch_train()
        return cmds

    def _rebalance(self, ready: list[int]) -> list[Command]:
        """Once the rollout queue is empty, sequences in flight on the most loaded rollout devices
        migrate to the least loaded (``Scheduler.rebalance``), those with the fewest tokens to
        re-prefill first: a device left with a big batch decodes every step of its longest
        sequence slower for it, while a device that emptied idles. (Judgments are not moved:
        with at most a few hundred tokens left to write, their re-prefill costs about what
        a smaller batch saves.)"""
        self._rebalance_due = False  # until sequences end, come back or a device joins the role
        cmds: list[Command] = []
        so_far = self.tokens_so_far
        for d, uids in self.scheduler.rebalance(ready, lambda u: so_far.get(u, 0)).items():
            cmds.append(Abort(d, tuple(uids)))
            self.devices[d].aborting = True
        return cmds

    def demand(self) -> Demand:
        s = self.scheduler
        loads = s.loads(len(self.devices))
        gen = len(s.gen_queue) + self._role_load(Role.ROLLOUT, loads)
        judge = len(s.judge_queue) + self._role_load(Role.JUDGE, loads)
        view = self._plan_view() if self.policy.wants_view else None
        return Demand(gen, judge, self.train_ready, self.training, loads, view)

    def _role_load(self, role: Role, loads: tuple[int, ...]) -> int:
        """Requests in flight on the devices holding ``role``: their loads picked in C (an
        ``itemgetter`` kept until a device joins or leaves the role), not read one by one."""
        pick = self._pick_role.get(role)
        if pick is None:
            ids = sorted(self._holders[role])
            if len(ids) > 1:
                pick = itemgetter(*ids)
            else:  # (an itemgetter of one index gives the item, not a tuple)
                pick = lambda loads, ids=ids: [loads[i] for i in ids]  # noqa: E731
            self._pick_role[role] = pick
        return sum(pick(loads))

    def _plan_view(self) -> PlanView:
        return PlanView(self.clock(), self._layout, self.workload)

    def _layout(self) -> tuple[tuple[Role | None, ...], frozenset[int]]:
        """The role of every device as the planner sees it, and the devices it may not move."""
        # (a lost device too: planned into a role, it would count there, and a step that needs as many train
        # devices would wait for one that does not come)
        pinned = frozenset(
            d.id for d in self.devices if d.shifting or d.training or d.accumulating or d.grads or d.aborting or d.lost
        )
        # a device on its way to a role counts as holding it: planned back to the role it is
        # leaving, it would shift straight back on arrival
        roles = tuple(d.heading if d.shifting else d.leaving or d.role for d in self.devices)
        return roles, pinned

    def workload(self) -> Workload:
        """What is left in the step, in the planner's terms."""
        s = self.scheduler
        rollout = sorted(self._holders[Role.ROLLOUT])  # (in device order, as a pass over the devices gives)
        running = [uid for d in rollout for uid in s.running(d)]
        gen_uids = [r.uid for r in s.gen_queue] + running
        judge_devs = sorted(self._holders[Role.JUDGE])
        judging = [uid for d in judge_devs for uid in s.running(d)]
        step, g = self.step, self.spec.group_size
        groups_left = 0
        if step is not None:  # (lockstep: a buffered group is not backpropagated yet: every group is, at the step)
            groups_left = -(-(len(step.samples) - (0 if self.spec.lockstep_train else step.accumulated)) // g)
        by_uid, m = self.by_uid, self.measured

        def reads(uids: Iterable[int]) -> int:
            return sum(len(by_uid[u].prompt_ids) + len(by_uid[u].response_ids) for u in uids if u in by_uid)

        # a judgment its device has started (it reported tokens written) has read its prompt there
        so_far = self.tokens_so_far
        read_running = reads(uid for uid in judging if uid not in so_far)
        read = read_running + reads(r.uid for r in s.judge_queue)
        # the groups left are the ones with the longest responses (those end last): their tokens as known so
        # far, a response still generating at what it has written (the planner adds what it expects to come)
        prompt = m["prompt_tokens"]
        # (lockstep: every sample of the step is backpropagated at its optimizer step, the buffered ones too)
        lockstep = self.spec.lockstep_train
        left = [x for i, x in enumerate(step.samples) if lockstep or i not in step.backward] if step is not None else []
        train_tokens = sum(len(x.prompt_ids) + len(x.response_ids) if x.response_ids else prompt + so_far.get(x.uid, 0)
                           for x in left)  # fmt: skip
        per_group = train_tokens / len(left) * g if left else (prompt + m["response_tokens"]) * g
        return Workload(
            rollout_remaining=[self.tokens_so_far.get(uid, 0) for uid in gen_uids],
            rollout_groups=[by_uid[u].prompt_index if u < EVAL_UID and u in by_uid else -1 for u in gen_uids],
            rollout_queued=len(s.gen_queue),
            # rebalanced, the running sequences spread over every rollout device (0: any may hold them)
            rollout_holders=0 if self.spec.rebalance else sum(1 for d in rollout if s.load(d)),
            judge_queued=len(s.judge_queue) + len(judging),
            judge_running=len(judging),
            judge_holders=sum(1 for d in judge_devs if s.load(d)),
            judge_future=sum(1 for uid in gen_uids if uid < EVAL_UID),
            judge_tokens_mean=self.measured["judge_tokens"],
            train_groups_left=groups_left,
            train_groups_ready=-(-len(self.train_queue) // g),
            train_groups_judging=0
            if step is None
            else sum(1 for p, n in step.group_generated.items() if n == g and step.group_judged.get(p, 0) < g),
            train_tokens_per_group=per_group,
            train_group_size=g,
            step_seconds=self.measured["step_seconds"],
            prompt_tokens_mean=self.measured["prompt_tokens"],
            judge_read_tokens=read,
            judge_read_running=read_running,
            judge_left_running=sum(self._verdict_left(so_far.get(uid, 0)) for uid in judging),
            judge_written=[so_far.get(uid, 0) for uid in judging],
            judge_reread=self.measured["judge_reread"],
            lockstep_train=self.spec.lockstep_train,
            # (an optimizer step still to run: it waits for as many train devices)
            train_devices_needed=self._train_needed() if step is not None and not self.training else 0,
        )

    def _measure(self, event: Event) -> None:
        """Running means the planner's workload is expressed in."""
        m, a = self.measured, 0.2
        seen = self._first_judgments
        if isinstance(event, Judged) and event.results and seen is not None:
            # (judgments too are averaged over whole steps once there is one, in _on_trained: a judge
            # that reasons writes judgments of very different lengths, and the long ones end last; a
            # running mean of the first step's judgments until then)
            seen[0] += sum(r.tokens for r in event.results)
            seen[1] += len(event.results)
            m["judge_tokens"] = seen[0] / seen[1]
        elif isinstance(event, Generated) and event.results:
            # (response lengths are averaged over whole steps, in _on_trained: the responses that
            # finish first are the short ones, and those that finish last the long ones)
            prompt = sum(len(r.prompt_ids) for r in event.results) / len(event.results)
            m["prompt_tokens"] += a * (prompt - m["prompt_tokens"])
        elif isinstance(event, Trained):  # (the update alone: a lockstep trainer's backward is priced as such)
            m["step_seconds"] += a * (event.seconds - event.backward_seconds - m["step_seconds"])

    # -- steps ----------------------------------------------------------------------
    def _begin_step(self, step: int) -> None:
        spec = self.spec
        rng = random.Random(spec.seed * 7919 + step)
        chosen = rng.sample(self.train_set, spec.prompts_per_step)
        samples, reqs = [], []
        for p_idx, prob in enumerate(chosen):
            prompt = self._prompt(prob.question)
            for g in range(spec.group_size):
                uid = p_idx * spec.group_size + g
                seed = sequence_seed(spec.seed, step, uid)
                samples.append(Sample(uid, p_idx, prob.question, prob.reference, [], seed, policy_version=self.version))
                reqs.append(GenRequest(uid, prompt, seed, spec.rollout))
        self.step = StepRecord(step, samples, self.clock())
        self.by_uid = {s.uid: s for s in samples}
        self.scheduler.submit_gen(reqs)

    def _begin_eval(self, after_step: int) -> None:
        if len(self.heldout) >= EVAL_STRIDE:
            raise ValueError(f"at most {EVAL_STRIDE - 1} held-out problems are evaluated, got {len(self.heldout)}")
        self.eval_hits[after_step] = {}
        base = EVAL_UID + after_step * EVAL_STRIDE
        reqs = [
            GenRequest(base + i, self._prompt(p.question), 0, self.spec.eval_params) for i, p in enumerate(self.heldout)
        ]
        self.scheduler.submit_gen(reqs, front=True)

    def _eval_due(self, step: int) -> bool:
        every = self.spec.eval_every
        return step == self.spec.steps or (every > 0 and step % every == 0)

    # -- events ---------------------------------------------------------------------
    def _on_shift(self, e: ShiftDone) -> None:
        d = self.devices[e.device]
        if d.role is not None:
            self._holders[d.role].discard(d.id)
            self._pick_role.pop(d.role, None)
        self._holders[e.role].add(d.id)
        self._pick_role.pop(e.role, None)
        d.role, d.version, d.shifting, d.shard = e.role, e.version, False, False
        self._rebalance_due |= e.role is Role.ROLLOUT
        self.shift_log.append(e)
        if self.step is not None:
            self.step.shifts += 1
            self.step.shift_seconds += e.seconds

    def _on_progress(self, e: Progress) -> None:
        """Live measurements; the planner of shiftable mode learns its profiles from them."""
        self.tokens_so_far.update(e.tokens_so_far)  # (uid, tokens) pairs: responses, or verdicts being written
        if e.role is Role.JUDGE and self.step is not None:
            self.step.judge_prefill_tokens += e.prefill_tokens

    def _on_lost(self, e: DeviceLost) -> None:
        """A device died or hung: its work begins again elsewhere (see ``DeviceLost``), the plan goes on
        without it until it joins again."""
        d = self.devices[e.device]
        where = f"device {e.device} ({d.role.value if d.role else 'no role'})"
        step = self.step.step if self.step else self.spec.steps
        if d.training and self.spec.sharded_train:
            raise DeviceLostError(f"{where} was lost in the optimizer step of step {step}: {e.reason}")
        if d.training:  # the step is done again (StepFailed comes with this) or was done (Trained came first)
            d.held = []
        if d.shard:
            raise DeviceLostError(f"{where} was lost holding its shard of the sharded train state: {e.reason}")
        if d.role is not None:
            self._holders[d.role].discard(d.id)
            self._pick_role.pop(d.role, None)
        redo_gen, redo_judge = [], []
        for uid in sorted(self.scheduler.running(e.device)):
            self.tokens_so_far.pop(uid, None)
            if d.role is Role.JUDGE:
                s = self.by_uid[uid]
                redo_judge.append(
                    JudgeRequest(
                        s.uid, s.question, s.reference, s.response_text, s.seed, self.spec.judge, group=s.prompt_index
                    )
                )
            else:
                redo_gen.append(self._gen_request(uid))
        self.scheduler.forget(e.device)
        self.scheduler.submit_gen(redo_gen, front=True)
        self.scheduler.submit_judge(redo_judge, front=True)
        recovered = len(redo_gen) + len(redo_judge)
        if d.held and self.step is not None:  # its gradients are gone: those samples go through backward again
            rec = self.step
            rec.accumulated -= len(d.held) - d.accumulating  # (those of an Accumulate in flight were not counted)
            rec.backward.difference_update(d.held)
            self.train_queue.extendleft(reversed(d.held))
            recovered += len(d.held)
        if self.step is not None:
            self.step.recovered += recovered
        self.devices[e.device] = DeviceView(e.device, lost=True)
        self._touched.add(e.device)
        self._looked = (None, -1)  # every device is looked at again: the roles are to be spread anew
        self._rebalance_due = True
        self.lost_log.append((self.clock(), e.device, e.reason))

    def _on_step_failed(self, e: StepFailed) -> None:
        """The update did not happen: every sample of the step goes through backward again, on train devices
        that take their state up afresh from the GPS (version ``e.version`` and its optimizer state)."""
        assert self.step is not None and self.training and e.version == self.version
        rec = self.step
        self.failed_updates += 1
        if self.failed_updates >= UPDATE_ATTEMPTS:
            raise DeviceLostError(
                f"the optimizer step of step {rec.step} failed {self.failed_updates} times in a row (last: {e.reason})"
            )
        self.training, self.train_ready = False, True
        for i in e.devices:
            d = self.devices[i]
            d.training = d.grads = False
            d.accumulating = 0
            d.held = []
            d.version = -1  # stale: the pump shifts it into the train role again, reloading from the GPS
        rec.accumulated = 0
        rec.backward.clear()
        self.train_queue = deque(i for i in range(len(rec.samples)) if i in rec.advantages)
        rec.recovered += len(self.train_queue)
        self._looked = (None, -1)

    def _on_joined(self, e: DeviceJoined) -> None:
        self.devices[e.device] = DeviceView(e.device)
        self._touched.add(e.device)
        self._looked = (None, -1)

    def _gen_request(self, uid: int) -> GenRequest:
        """A generation request from the start: a rollout sample's, or a held-out problem's."""
        if uid >= EVAL_UID:
            p = self.heldout[(uid - EVAL_UID) % EVAL_STRIDE]
            return GenRequest(uid, self._prompt(p.question), 0, self.spec.eval_params)
        s = self.by_uid[uid]
        return GenRequest(uid, self._prompt(s.question), s.seed, self.spec.rollout)

    def _prompt(self, question: str) -> str:
        """What the policy reads for a question: the task's prompt, in its chat template when it has one."""
        prompt = self.spec.prompt_template.format(question=question)
        return self.spec.chat(prompt) if self.spec.chat is not None else prompt

    def _on_aborted(self, e: Aborted) -> None:
        """Requests taken from a device (it leaves its role, or hands its excess over when the
        rollout is rebalanced) go back to the front of their queue."""
        self.devices[e.device].aborting = False
        self._rebalance_due = True
        for r in (*e.gen, *e.judge):
            self.scheduler.finished(e.device, r.uid)
        for r in e.judge:  # a judgment moved reads its prompt again where it goes
            self.tokens_so_far.pop(r.uid, None)
        moved = [r for r in (*e.gen, *e.judge) if r.uid < EVAL_UID]  # every sequence moved, either role
        for r in moved:
            self.by_uid[r.uid].migrations += 1
        if self.step is not None:
            self.step.migrations += len(moved)
        self.scheduler.submit_gen(list(e.gen), front=True)
        self.scheduler.submit_judge(list(e.judge), front=True)

    def _on_generated(self, e: Generated) -> None:
        self._rebalance_due = True
        judge_reqs, whole = [], []
        for r in e.results:
            self.scheduler.finished(e.device, r.uid)
            self.tokens_so_far.pop(r.uid, None)  # (a held-out answer's too: its uid is not used again)
            if r.uid >= EVAL_UID:
                self._on_evaluated(r.uid, r.text)
                continue
            s = self.by_uid[r.uid]
            assert r.version == s.policy_version, f"sample {r.uid}: v{r.version} served a v{s.policy_version} step"
            s.prompt_ids, s.response_ids, s.logprobs, s.response_text = r.prompt_ids, r.output_ids, r.logprobs, r.text
            s.truncated = r.finish_reason == "length"
            s.status = Status.TRUNCATED if s.truncated else Status.FINISHED
            s.correct = self.spec.check(r.text, s.reference)
            assert self.step is not None
            self.step.generated += 1
            generated = self.step.group_generated[s.prompt_index] = self.step.group_generated.get(s.prompt_index, 0) + 1
            if self.step.generated == len(self.step.samples):
                self.step.rollout_end = self.clock()
                g = self.spec.group_size
                self.step.groups_judged_at_rollout_end = sum(n == g for n in self.step.group_judged.values())
            judge_reqs.append(
                JudgeRequest(
                    s.uid, s.question, s.reference, s.response_text, s.seed, self.spec.judge, group=s.prompt_index
                )
            )
            if generated == self.spec.group_size:
                whole.append(s.prompt_index)
                self.step.group_whole_at[s.prompt_index] = self.clock()
        self.scheduler.submit_judge(judge_reqs)
        for p in whole:  # its judgments go first: the group trains once they are done
            assert self.step is not None
            g, samples = self.spec.group_size, self.step.samples
            self.scheduler.judge_first({samples[i].uid for i in range(p * g, (p + 1) * g)})

    def _verdict_left(self, written: int) -> float:
        """Tokens a judgment that has written ``written`` is expected still to write: the mean over the
        last step's judgments longer than that (one at least), or the running mean less what it wrote."""
        lengths, suffix = self._judgments
        i = bisect.bisect_right(lengths, written)
        if i == len(lengths):  # no step yet, or longer than any judgment of the last
            return max(1.0, self.measured["judge_tokens"] - written) if not lengths else 1.0
        return suffix[i] / (len(lengths) - i) - written

    def _judge_weight(self, uid: int) -> float:
        """The work of judging a sample: the tokens its judgment reads (the prompt and the response),
        fixed once it is generated. Where a decode step is bound by reading KV caches (a GPU's large
        batches), a judgment costs about its context at every step of its verdict and holds that much
        of the paged cache. (On a CPU every judgment costs about the same, and the device handed the
        short ones takes up to twice the others'; adding the mean judgment length evens that out but
        cost the simulated 128-GPU judge-32b job 3.7%, 66.8 to 64.3 samples/s.)"""
        s = self.by_uid[uid]
        return float(len(s.prompt_ids) + len(s.response_ids))

    def _on_evaluated(self, uid: int, text: str) -> None:
        after_step, index = divmod(uid - EVAL_UID, EVAL_STRIDE)
        hits = self.eval_hits[after_step]
        hits[index] = self.spec.check(text, self.heldout[index].reference)
        if len(hits) == len(self.heldout):
            self.accuracy[after_step] = sum(hits.values()) / len(self.heldout)
            del self.eval_hits[after_step]
            self._maybe_close()

    def _on_judged(self, e: Judged) -> None:
        assert self.step is not None
        if self.step.first_judged is None:
            self.step.first_judged = self.clock()
        for r in e.results:
            self.scheduler.finished(e.device, r.uid)
            self.tokens_so_far.pop(r.uid, None)
            s = self.by_uid[r.uid]
            j = self.genrm.score(r.text, truncated=r.truncated)
            self.step.judge_stats.add(j)
            s.judge_text, s.judge_tokens, s.reward, s.verdict = r.text, r.tokens, j.reward, j.label
            s.status = Status.JUDGED
            self.step.judged += 1
            self.step.judge_tokens += r.tokens
            done = self.step.group_judged.get(s.prompt_index, 0) + 1
            self.step.group_judged[s.prompt_index] = done
            if done == self.spec.group_size:  # the whole group is judged: its advantages are known
                self._queue_group(s.prompt_index)
                now = self.clock()
                self.step.group_waits.append(now - self.step.group_whole_at.get(s.prompt_index, now))
        if self.step.judged == len(self.step.samples):
            self.train_ready = True
            self.step.judge_end = self.clock()

    def _queue_group(self, p: int) -> None:
        """A judged group's samples, with their advantages, join the train queue."""
        assert self.step is not None
        g, samples = self.spec.group_size, self.step.samples
        idx = range(p * g, (p + 1) * g)
        adv = group_advantages([samples[i].reward for i in idx], g, self.spec.scale_by_std)
        self.step.advantages.update(zip(idx, adv, strict=True))
        self.train_queue.extend(idx)

    def _train_tokens(self, i: int) -> int:
        assert self.step is not None
        s = self.step.samples[i]
        return len(s.prompt_ids) + len(s.response_ids)

    def _dispatch_train(self) -> list[Command]:
        """Backward of judged samples on the train devices as they come in; the optimizer
        step once every sample of the step is in."""
        if self.step is None or self.training:
            return []
        n = len(self.step.samples)
        if not self.train_queue and self.step.accumulated < n:  # nothing to hand out, the step not due
            return []
        train_devs = tuple(i for i in self.policy.train_devices() if not self.devices[i].lost)
        if not train_devs:
            return []
        cmds: list[Command] = []
        # devices already holding gradients first: they stay in the role until the optimizer step
        # anyway, while a device given its first samples is pinned there too, out of the planner's reach
        devices, version = self.devices, self.version
        usable = [
            i for i in train_devs
            if (d := devices[i]).role is Role.TRAIN and d.version == version and not (d.shifting or d.accumulating)
        ]  # fmt: skip
        free = [i for i in usable if devices[i].grads] + [i for i in usable if not devices[i].grads]
        share = 0.0
        if self.train_queue and free:
            # an even share of the tokens queued now, counting train devices still shifting in, and
            # never more than every device's share of the step: a backlog handed whole to the few
            # devices training when it arrives would run on them alone while the devices the plan
            # sends next find an empty queue; small shares rebalance as devices free up. Shares are
            # counted in tokens, not groups: the groups judged last hold the longest responses
            queued = sum(map(self._train_tokens, self.train_queue))
            share = min(queued / len(train_devs), queued / len(self.train_queue) * -(-n // len(self.devices)))
        for i in free:
            if not self.train_queue:
                break
            take = [self.train_queue.popleft()]
            tokens = self._train_tokens(take[0])
            while self.train_queue and tokens + self._train_tokens(self.train_queue[0]) / 2 <= share:
                take.append(self.train_queue.popleft())  # to the nearest sample
                tokens += self._train_tokens(take[-1])
            self.step.backward.update(take)
            self.devices[i].held += take
            cmds.append(Accumulate(i, self.version, self._shard(take)))
            self.devices[i].accumulating, self.devices[i].grads = len(take), True
            if self.step.train_start is None:
                self.step.train_start = self.clock()
        # every backward done (so nothing was handed out above), every train device free, and enough of them
        if self.step.accumulated == n and len(free) == len(train_devs) >= self._train_needed():
            assert all(not d.grads or d.id in train_devs for d in self.devices), "gradients on a non-train device"
            self.training, self.train_ready = True, False
            for i in train_devs:
                self.devices[i].training = True
            tokens = sum(len(s.response_ids) for s in self.step.samples)
            every, step = self.spec.checkpoint_every, self.step.step
            checkpoint = bool(every) and step % every == 0 and step < self.spec.steps
            cmds.append(Step(train_devs, self.version, tokens, checkpoint))
        return cmds

    def _train_needed(self) -> int:
        """Train devices the optimizer step waits for: ``min_train_devices``, or as many as could still train if
        fewer: every device not lost where the policy plans (it brings them), the static layout's train devices
        not lost otherwise (nothing would bring another: waiting for one would stall the job)."""
        could = range(len(self.devices)) if self.policy.wants_view else self.policy.train_devices()
        return min(self.spec.min_train_devices, sum(1 for d in could if not self.devices[d].lost))

    def _shard(self, idx: list[int]) -> TrainShard:
        assert self.step is not None
        samples, adv = self.step.samples, self.step.advantages
        return TrainShard(
            tuple(samples[i].prompt_ids for i in idx),  # the samples' own lists, not copies: read-only
            tuple(samples[i].response_ids for i in idx),
            tuple(samples[i].logprobs for i in idx),
            tuple(adv[i] for i in idx),
        )

    def _on_accumulated(self, e: Accumulated) -> None:
        assert self.step is not None
        self.devices[e.device].accumulating = 0
        self.step.accumulated += e.samples

    def _on_trained(self, e: Trained) -> None:
        assert self.step is not None
        self.version = e.version
        self.failed_updates = 0
        for d in self.devices:
            d.held = []
        for i in e.devices:
            d = self.devices[i]
            d.training, d.grads = False, False
            d.version = e.version  # the trainer's replica is the new version
            d.shard = self.spec.sharded_train
        self.training = False
        self.step.train_stats = e.stats
        samples = self.step.samples
        self.measured["response_tokens"] = sum(len(s.response_ids) for s in samples) / max(1, len(samples))
        self.measured["judge_tokens"] = sum(s.judge_tokens for s in samples) / max(1, len(samples))
        lengths = sorted(s.judge_tokens for s in samples)
        self._judgments = (lengths, list(itertools.accumulate(reversed(lengths), initial=0))[::-1])
        # what the judge read per token of the judged prompts and responses: its template, and the
        # judgments a full paged cache preempted, read again (a step's own, as lengths are)
        reads = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        if reads and self.step.judge_prefill_tokens:
            self.measured["judge_reread"] = self.step.judge_prefill_tokens / reads
        self._first_judgments = None
        self.step.finished = self.clock()
        self.pending_metrics[self.step.step] = self._step_metrics(self.step)
        self.finished_steps.append(self.step)
        done_step = self.step.step
        if self._eval_due(done_step):
            self._begin_eval(done_step)
        every = self.spec.checkpoint_every
        if every and done_step % every == 0 and done_step < self.spec.steps and set(self.eval_hits) <= {done_step}:
            self.checkpoint_due = done_step  # the driver writes it before the next commands go out
        if done_step < self.spec.steps:
            self._begin_step(done_step + 1)
        else:
            self.step = None
        self._maybe_close()

    def _maybe_close(self) -> None:
        """Emit finished steps' metrics in order, each once its evaluation (if due) is in; end after the last."""
        while self.pending_metrics:
            step = min(self.pending_metrics)
            if step in self.eval_hits:  # its evaluation is still running
                return
            m = self.pending_metrics.pop(step)
            if step in self.accuracy:
                m["heldout_accuracy"] = self.accuracy[step]
            self.metrics.append(m)
            if step == self.spec.steps:
                self.done = True

    def _step_metrics(self, rec: StepRecord) -> dict[str, Any]:
        samples, n = rec.samples, len(rec.samples)
        resp_tokens = sum(len(s.response_ids) for s in samples)
        seconds = (rec.finished or rec.started) - rec.started
        return {
            "step": rec.step,
            "reward_mean": sum(s.reward for s in samples) / n,
            "accuracy": sum(bool(s.correct) for s in samples) / n,
            "judge_agreement": sum((s.reward >= self.top_reward) == bool(s.correct) for s in samples) / n,
            "parse_failures": rec.judge_stats.parse_failures,
            "judge_outcomes": dict(rec.judge_stats.by_outcome),
            "response_length": resp_tokens / n,
            "truncated": sum(s.truncated for s in samples),
            "response_tokens": resp_tokens,
            "judge_tokens": rec.judge_tokens,
            "step_seconds": seconds,
            "samples_per_s": n / seconds if seconds > 0 else 0.0,
            "tokens_per_s": (resp_tokens + rec.judge_tokens) / seconds if seconds > 0 else 0.0,
            "time_s": phase_times(rec),
            # how long groups wait for the judge once generated whole (their backward waits as long), and how
            # many could train when the rollout ended: where a step's time after its rollout comes from
            "group_wait_s": quantiles(rec.group_waits),
            "groups_judged_at_rollout_end": rec.groups_judged_at_rollout_end,
            "shifts": rec.shifts,
            "migrations": rec.migrations,
            "recovered": rec.recovered,
            "shift_seconds": rec.shift_seconds,
            **{f"train_{k}": v for k, v in rec.train_stats.items() if k != MISMATCH},
            # mean |trainer - engine| log-prob of the step's response tokens (the engine's numerical drift)
            **({MISMATCH: rec.train_stats[MISMATCH]} if MISMATCH in rec.train_stats else {}),
        }


MISMATCH = "logprob_mismatch"


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile (interpolated between the values) and maximum of ``values``; zeros for none."""
    if len(values) < 2:
        x = values[0] if values else 0.0
        return {"median": x, "p90": x, "max": x}
    p90 = statistics.quantiles(values, n=10, method="inclusive")[-1]
    return {"median": statistics.median(values), "p90": p90, "max": max(values)}


def phase_times(rec: StepRecord) -> dict[str, float]:
    """Wall time of each phase of a step. Phases may overlap (judging streams
    while rollout runs), so they need not add up to the step time."""
    end = rec.finished or rec.started
    rollout_end = rec.rollout_end or end
    judge_end = rec.judge_end or end
    return {
        "rollout": rollout_end - rec.started,
        "judge": judge_end - (rec.first_judged or rollout_end),
        "train": end - (rec.train_start or end),
        "step": end - rec.started,
    }
