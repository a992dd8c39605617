"""The RL step loop as an event-driven state machine.

What waits for what (on-policy GRPO):

    rollout of step k   -- needs -->  policy weights of version k-1 on the device
    judging a response  -- needs -->  that response finished (streamed, one by one)
    backward of a group -- needs -->  every reward of that group (its advantages)
    the update of step k -- needs --> every backward of step k, on enough train devices
    rollout of step k+1 -- needs -->  the update of step k (version k) published

Evaluation of version k runs as greedy generation requests next to the
rollout of step k+1 (same weights), and its accuracy is reported with step k:
a step's metrics go out in order, each once its evaluation (if due) is in.

With ``max_staleness = m > 0`` the rollout of step k+1 waits only for version
k - m: up to m + 1 steps are in flight, each with its book; the oldest is the
one judged whole first and trained (versions go up one step at a time), the
others generate and judge beside it. A rollout device serves the newest
version (one left behind by an update finishes what it runs, then reloads),
so a sample lags at most m versions behind the one its step trains. A
sequence moved off a device that an update left behind begins again (its
tokens so far are of an older version). The optimizer step waits for the
evaluation of the current version (it runs on it), and a step after which a
checkpoint is due is trained before the next begins: the checkpoint holds no
step in flight.

The controller only reacts: ``start()`` and ``handle(event)`` update the parts
and return the commands the state allows (``pump``): shifts and aborts towards
the allocation policy's targets, queued requests to the devices holding their
role, backward and the optimizer step. The parts know nothing of the loop:

    StepBook         one step's samples, groups, advantages, backward queue   book.py
    Fleet            device views and roles; targets -> shifts and aborts      fleet.py
    Scheduler        request queues, their spread over devices, migration      scheduler.py
    RequestDispatch  queued requests to ready devices, the rollout rebalanced  dispatch.py
    TrainDispatch    backward of judged groups, the optimizer step             training.py
    Evaluation       held-out evaluation of a step's weights                   evaluation.py
    LiveStats        running means, what running sequences have written        live.py
    Recovery         lost devices: their work begins again                     recovery.py
    StepReports      finished steps' metrics, in order                         metrics.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pivotrl.control.book import StepBook, StepRecord
from pivotrl.control.dispatch import RequestDispatch
from pivotrl.control.evaluation import Evaluation, is_eval
from pivotrl.control.fleet import Fleet
from pivotrl.control.live import LiveStats
from pivotrl.control.messages import (
    Aborted,
    Accumulated,
    Command,
    DeviceJoined,
    DeviceLost,
    Event,
    Generated,
    GenRequest,
    Judged,
    Progress,
    Role,
    ShiftDone,
    StepFailed,
    Trained,
)
from pivotrl.control.metrics import StepReports, step_metrics
from pivotrl.control.modes import AllocationPolicy, Demand
from pivotrl.control.profiles import Workload
from pivotrl.control.recovery import Recovery
from pivotrl.control.remaining import remaining_work
from pivotrl.control.scheduler import Scheduler
from pivotrl.control.shiftable import PlanView
from pivotrl.control.spec import STEP_UID, DeviceLostError, LoopSpec, sequence_seed
from pivotrl.control.training import TrainDispatch, train_needed
from pivotrl.reward.genrm import GenRM
from pivotrl.sample import Problem, Sample

__all__ = ["Controller", "DeviceLostError", "LoopSpec", "StepRecord", "sequence_seed"]


class Controller:
    """The step loop over its parts. What drivers read: ``done``, ``metrics`` (finished steps' rows, in order),
    ``accuracy``, ``finished_steps`` (their records, drained by the driver), ``version``, ``checkpoint_due`` and
    ``checkpoint()``, ``first_step``, ``shift_log``, ``lost_log``; ``demand()`` and ``workload()`` for planning."""

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
        self.spec, self.policy, self.genrm, self.train_set, self.clock = spec, policy, genrm, train_set, clock
        self.fleet = Fleet(policy.devices, spec.partial_rollout)
        weight = lambda uid: float(self._book_of(uid).reads(uid))  # noqa: E731  (a judgment's work: StepBook.reads)
        self.scheduler = Scheduler(spec.per_device, spec.judge_per_device or None, weight, spec.judge_kv or None)
        self.evaluation = Evaluation(heldout, spec.eval_params, spec.eval_every, spec.steps, spec.prompt, spec.check)
        self.stats = LiveStats(spec.judge.max_new_tokens, spec.rollout.max_new_tokens)
        self.requests = RequestDispatch(spec.rebalance)
        self.train = TrainDispatch(spec.checkpoint_every, spec.steps, clock)
        self.recovery = Recovery(spec.sharded_train)
        self.version = 0
        self.books: dict[int, StepBook] = {}  # the steps in flight, oldest first (one at a time on-policy)
        self._slots: dict[int, StepBook] = {}  # their books by slot (a request's uid // STEP_UID)
        self._samples: dict[int, Sample] = {}  # the samples of the steps in flight by request uid (the planner's)
        self._next_step = 1  # the next step to begin
        self.reports = StepReports(spec.steps)
        self.metrics: list[dict[str, Any]] = []  # finished steps, in order
        self.finished_steps: list[StepRecord] = []  # finished steps' records, for the run's samples.jsonl; drained
        self.shift_log: list[ShiftDone] = []
        self._handlers: dict[type, Callable[[Any], None]] = {
            ShiftDone: self._on_shift, Generated: self._on_generated, Judged: self._on_judged,
            Trained: self._on_trained, Aborted: self._on_aborted, Accumulated: self._on_accumulated,
            Progress: self._on_progress, DeviceLost: self._on_lost, DeviceJoined: self._on_joined,
            StepFailed: self._on_step_failed,
        }  # fmt: skip
        self.done = False
        self.top_reward = max(genrm.rewards.values())
        self.first_step = 1  # the step this run starts at (later when it resumes a checkpoint)
        self.checkpoint_due: int | None = None  # a finished step whose checkpoint the driver is to write now
        self._resume_evals: list[int] = []
        if resume is not None:
            self._restore(resume)

    @property
    def book(self) -> StepBook | None:
        """The oldest step in flight: the one trained next (None once the last is trained)."""
        return next(iter(self.books.values()), None)

    def _book_of(self, uid: int) -> StepBook:
        """The book of a training sample's request."""
        return self._slots[uid // STEP_UID]

    @property
    def accuracy(self) -> dict[int, float]:
        """Step -> held-out accuracy after it."""
        return self.evaluation.accuracy

    @property
    def lost_log(self) -> list[tuple[float, int, str]]:
        """(when, device, why) of every device lost."""
        return self.recovery.log

    # -- the loop -------------------------------------------------------------------
    def start(self) -> list[Command]:
        if self.first_step == 1:
            self._begin_eval(0)
        for after in self._resume_evals:  # the evaluation that was running when the checkpoint was written
            self._begin_eval(after)
        self._next_step = self.first_step
        self._begin_steps()
        return self.pump()

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
        kind = type(event)  # (a table, not a chain of isinstance: this runs for every event)
        handler = self._handlers.get(kind)
        if handler is None:
            raise TypeError(f"unknown event {event!r}")
        if kind is Trained or kind is StepFailed:
            self.fleet.touch(event.devices)
        elif kind is not Progress:  # (a progress report changes no device's state)
            self.fleet.touch((event.device,))
        previous = self.fleet[event.device].role if kind is ShiftDone else None  # (StepFailed: no .device)
        self.policy.observe(event, previous)
        if kind is not Progress:
            self.stats.observe(event)
        handler(event)

    def pump(self) -> list[Command]:
        """Commands that the current state allows: shifts towards the policy's
        targets, queued requests to devices holding their role, the update."""
        if self.done:
            return []
        demand = self.demand()
        cmds = self.fleet.steer(self.policy.targets(demand), demand.loads, self.version, self.policy.preempt)
        cmds += self.requests.dispatch(self.scheduler, self.fleet, self.version, self.stats.so_far)
        book = self.book
        if book is not None:
            # overlapping steps: the update waits for the evaluation of the version it replaces (which runs on it)
            hold = self.spec.max_staleness > 0 and self.version in self.evaluation.running
            cmds += self.train.dispatch(book, self.fleet, self.version, self.policy.train_devices, self._needed, hold)
        self.fleet.touch_commands(cmds)
        return cmds

    def demand(self) -> Demand:
        s, fleet = self.scheduler, self.fleet
        loads = s.loads(len(fleet))
        gen = len(s.gen_queue) + fleet.role_load(Role.ROLLOUT, loads)
        judge = len(s.judge_queue) + fleet.role_load(Role.JUDGE, loads)
        view = PlanView(self.clock(), fleet.layout, self.workload) if self.policy.wants_view else None
        return Demand(gen, judge, self.train.ready, self.train.stepping, loads, view)

    def workload(self) -> Workload:
        """What is left in the step, in the planner's terms."""
        needed = self._needed() if self.book is not None and not self.train.stepping else 0
        books = list(self.books.values())
        by_uid = books[0].by_uid if len(books) == 1 else self._samples
        return remaining_work(self.spec, self.scheduler, self.fleet, books, by_uid, self.stats, needed)

    def _needed(self) -> int:
        """Train devices the optimizer step waits for (``train_needed``)."""
        policy = self.policy
        return train_needed(self.fleet, policy.wants_view, policy.train_devices, self.spec.min_train_devices)

    # -- steps and their close ------------------------------------------------------
    def _begin_steps(self) -> None:
        """Begin every step the staleness bound allows: step s once version s - 1 - max_staleness is out, at most
        max_staleness + 1 in flight, none after a step in flight whose checkpoint is due (it is taken with no
        step in flight)."""
        spec, k = self.spec, self.spec.max_staleness
        every = spec.checkpoint_every
        while (
            (step := self._next_step) <= spec.steps
            and len(self.books) <= k
            and self.version >= step - 1 - k
            and not (every and any(s % every == 0 and s < spec.steps for s in self.books))
        ):
            slot = step % (k + 1)
            book, reqs = StepBook.draw(spec, step, self.version, self.train_set, self.clock(), slot * STEP_UID)
            self.books[step], self._slots[slot] = book, book
            if k:
                self._samples.update(book.by_uid)
            self.scheduler.submit_gen(reqs)
            self._next_step += 1

    def _begin_eval(self, after_step: int) -> None:
        self.scheduler.submit_gen(self.evaluation.begin(after_step), front=True)

    def _maybe_close(self) -> None:
        """Emit finished steps' metrics in order, each once its evaluation (if due) is in; end after the last."""
        self.done |= self.reports.emit(self.metrics, self.evaluation.running, self.accuracy)

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
            "evaluating": sorted(self.evaluation.running),
            "pending_metrics": {str(k): v for k, v in self.reports.pending.items()},
            "accuracy": {str(k): v for k, v in self.accuracy.items()},
            "measured": dict(self.stats.means),
            "judgments": self.stats.judgments,
            "planner": self.policy.state() if hasattr(self.policy, "state") else None,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        step, version = int(state["step"]), int(state["version"])
        if step >= self.spec.steps:
            raise ValueError(f"the checkpoint is of step {step}, the last of {self.spec.steps}: nothing to resume")
        self.first_step, self.version = step + 1, version
        self._resume_evals = [int(k) for k in state["evaluating"]]
        self.reports.pending = {int(k): v for k, v in state["pending_metrics"].items()}
        self.evaluation.accuracy = {int(k): float(v) for k, v in state["accuracy"].items()}
        self.stats.restore(state["measured"], state["judgments"])
        if state.get("planner") is not None and hasattr(self.policy, "restore"):
            self.policy.restore(state["planner"])

    # -- events ---------------------------------------------------------------------
    def _on_generated(self, e: Generated) -> None:
        """Responses in: each is judged; the judgments of a group generated whole go first (it trains once they
        are done). Held-out answers are scored."""
        self.requests.changed()
        now, judge_reqs, whole = self.clock(), [], []
        for r in e.results:
            self.scheduler.finished(e.device, r.uid)
            self.stats.ended(r.uid)  # (a held-out answer's too: its uid is not used again)
            if is_eval(r.uid):
                if self.evaluation.answered(r.uid, r.text):
                    self._maybe_close()
                continue
            book = self._book_of(r.uid)
            group = book.generated(r, now)
            judge_reqs.append(book.judge_request(r.uid))
            if group is not None:
                whole.append(book.group_uids(group))
        self.scheduler.submit_judge(judge_reqs)
        for uids in whole:
            self.scheduler.judge_first(set(uids))

    def _on_judged(self, e: Judged) -> None:
        now, books = self.clock(), []
        for r in e.results:
            self.scheduler.finished(e.device, r.uid)
            self.stats.ended(r.uid)
            book = self._book_of(r.uid)
            if book.record.first_judged is None:
                book.record.first_judged = now
            if not books or books[-1] is not book:
                books.append(book)
            book.judged(r, self.genrm.score(r.text, truncated=r.truncated), now)
        for book in books:
            if book.all_judged:
                book.record.judge_end = now
                if book is self.book:  # (a later step's waits its turn: ``_on_trained``)
                    self.train.ready = True

    def _on_accumulated(self, e: Accumulated) -> None:
        assert self.book is not None
        self.fleet.accumulated(e.device)
        self.book.record.accumulated += e.samples

    def _on_trained(self, e: Trained) -> None:
        """The update is published: the step closes (its evaluation begins if due, its checkpoint if due), the
        next begins."""
        assert self.book is not None
        rec, spec = self.book.record, self.spec
        closed = self.books.pop(rec.step)
        del self._slots[rec.step % (spec.max_staleness + 1)]
        for uid in closed.by_uid if spec.max_staleness else ():
            del self._samples[uid]
        self.version = e.version
        self.train.trained()
        self.fleet.stepped(e.devices, e.version, spec.sharded_train)  # the trainer's replica is the new version
        rec.train_stats = e.stats
        self.stats.step_trained(rec.samples, rec.judge_prefill_tokens)
        rec.finished = self.clock()
        self.reports.add(rec.step, step_metrics(rec, self.top_reward, spec.max_staleness))
        self.finished_steps.append(rec)
        done_step = rec.step
        if self.evaluation.due(done_step):
            self._begin_eval(done_step)
        every = spec.checkpoint_every
        if every and done_step % every == 0 and done_step < spec.steps and set(self.evaluation.running) <= {done_step}:
            self.checkpoint_due = done_step  # the driver writes it before the next commands go out
        self._begin_steps()
        if self.book is not None and self.book.all_judged:  # a later step judged whole while this one trained
            self.train.ready = True
        self._maybe_close()

    def _on_shift(self, e: ShiftDone) -> None:
        self.fleet.shifted(e)
        if e.role is Role.ROLLOUT:
            self.requests.changed()
        self.shift_log.append(e)
        if self.book is not None:
            self.book.record.shifts += 1
            self.book.record.shift_seconds += e.seconds

    def _on_progress(self, e: Progress) -> None:
        """Live measurements; the planner of shiftable mode learns its profiles from them."""
        self.stats.progress(e.tokens_so_far)  # (uid, tokens) pairs: responses, or verdicts being written
        if e.role is Role.JUDGE and self.book is not None:
            self.book.record.judge_prefill_tokens += e.prefill_tokens

    def _on_aborted(self, e: Aborted) -> None:
        """Requests taken from a device (it leaves its role, or hands its excess over when the
        rollout is rebalanced) go back to the front of their queue."""
        self.fleet.aborted(e.device)
        self.requests.changed()
        for r in (*e.gen, *e.judge):
            self.scheduler.finished(e.device, r.uid)
        for r in e.judge:  # a judgment moved reads its prompt again where it goes
            self.stats.ended(r.uid)
        for r in (*e.gen, *e.judge):  # every sequence moved, either role
            if not is_eval(r.uid):
                self._book_of(r.uid).migrated([r.uid])
        gen, version = list(e.gen), self.fleet[e.device].version
        if self.spec.partial_rollout:  # its tokens so far go on, where an update left the device behind with
            for r in gen:  # newer weights: their version is marked
                if not is_eval(r.uid):
                    self._book_of(r.uid).moved(r.uid, len(r.output_ids), version)
            if version != self.version:
                gen = [replace(r, prefix_version=version) if r.output_ids else r for r in gen]
        elif version != self.version:  # an update left the device behind: its tokens are of an older version
            gen = [self._begun_again(r) for r in gen]  # than any device they could go on on
        self.scheduler.submit_gen(gen, front=True)
        self.scheduler.submit_judge(list(e.judge), front=True)

    def _begun_again(self, r: GenRequest) -> GenRequest:
        """A sequence from its beginning (its draws are its seed's: the same as at first, from a newer version)."""
        if not r.output_ids or is_eval(r.uid):  # (evaluation runs on one version: ``pump`` holds the update)
            return r
        self.stats.ended(r.uid)
        return self._book_of(r.uid).gen_request(r.uid)

    def _on_lost(self, e: DeviceLost) -> None:
        """A device died or hung: its work begins again elsewhere (see ``DeviceLost``), the plan goes on
        without it until it joins again."""
        book, view = self.book, self.fleet[e.device]
        self.recovery.check(view, book.step if book is not None else self.spec.steps, e.reason)
        self.fleet.lose(e.device)
        for uid in self.scheduler.running(e.device):
            self.stats.ended(uid)
        gen = lambda uid: self.evaluation.request(uid) if is_eval(uid) else self._book_of(uid).gen_request(uid)  # noqa: E731
        work = self.recovery.lost(
            view, self.scheduler, gen, lambda uid: self._book_of(uid).judge_request(uid), self.clock(), e.reason
        )
        if book is not None:
            if work.held:  # its gradients are gone: those samples go through backward again
                book.backward_lost(work.held, work.in_backward)
            book.record.recovered += len(work)
        self.requests.changed()

    def _on_step_failed(self, e: StepFailed) -> None:
        """The update did not happen: every sample of the step goes through backward again, on train devices
        that take their state up afresh from the GPS (version ``e.version`` and its optimizer state)."""
        assert self.book is not None and self.train.stepping and e.version == self.version
        self.train.update_failed(self.book.step, e.reason)
        self.fleet.step_failed(e.devices)
        self.book.record.recovered += self.book.update_failed()
        self.fleet.look_again()

    def _on_joined(self, e: DeviceJoined) -> None:
        self.fleet.join(e.device)
