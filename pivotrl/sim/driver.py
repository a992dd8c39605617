"""Simulator driver: the unchanged control plane against modeled devices on a virtual clock.

Same interface as the runtime's drivers (``submit``, ``next_events``,
``start_clock``, ``slices``, ``close``) plus ``clock``, the controller's
clock, so every timestamp of a simulated run is in virtual seconds. A
control-plane device is one model instance of ``tp`` GPUs, which runs a role
on one engine or on several smaller ones (``SimSpec.engine_tp``, priced by
``pivotrl.sim.layout``).

An event heap (vidur's loop): ``next_events`` pops the earliest completions,
advances the clock to them and returns their events, all those of one virtual
instant together (a grid point gathers every generating device's report, for
``Controller.handle_all``); ``submit`` schedules the follow-ups. Each command
is answered with the event kinds the runtime's ``Worker`` answers it with, in
the same situations:

    Shift      -> ShiftDone after the cost model's shift (a rollout instance taking the
                  next version: its weights refresh)
    Generate,  -> nothing at once; while the instance has work, every slice (``slice_s``
    Judge         virtual seconds, on a grid shared by all devices so reports come
                  together; cut short when the engine runs dry) a Progress, and a
                  Generated or Judged with the sequences that finished in it
    Abort      -> Aborted at once, requests carrying their tokens so far (after the
                  Progress and results of the slice it cuts short, if any)
    Accumulate -> Accumulated after the backward of its samples' tokens on the instance
    Step       -> one Trained after the optimizer step, data parallel over all the GPUs
                  of its devices; the new version is the old + 1

A shift, a backward and an optimizer step take the cost model's seconds, drawn
about them where it gives a spread (``CostModel.spread``: a measured profile's
variation; the roofline has none). A response's length is drawn from the
job's distribution by its seed and uid (with its group's draw where
``group_correlation`` ties them), or replayed from a recorded run.

Generation runs on a ``ModeledEngine`` per instance. A slice is planned when
it starts (the engine advanced to its end); a command reaching a device in the
middle of a slice takes the plan back to that moment and plans the rest again.

A control plane that keeps issuing commands while virtual time stands still
(answers that take no time, such as aborts, asked for again and again) would
loop forever here; after ``LIVELOCK_ROUNDS`` such rounds ``next_events`` raises
``StallError`` naming the latest commands.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from pivotrl.control.drive import StallError
from pivotrl.control.messages import (
    Abort,
    Aborted,
    Accumulate,
    Accumulated,
    Command,
    Event,
    Generate,
    Generated,
    GenRequest,
    GenResult,
    Judge,
    Judged,
    JudgeRequest,
    JudgeResult,
    Progress,
    Role,
    Shift,
    ShiftDone,
    Step,
    Trained,
)
from pivotrl.sim import synthetic
from pivotrl.sim.costs import SPREAD_KINDS, CostModel
from pivotrl.sim.engine import ModeledEngine, SimSeq
from pivotrl.sim.layout import EngineLayout, role_costs
from pivotrl.sim.models import ModelSpec
from pivotrl.sim.workload import LengthDist, correlated, normal_score
from pivotrl.telemetry import Slice


def _named(cmd: Command) -> str:
    """``Shift(3)``: a command's kind and device(s), for messages."""
    return f"{type(cmd).__name__}({getattr(cmd, 'device', getattr(cmd, 'devices', ''))})"


LIVELOCK_ROUNDS = 1000  # rounds of commands at one virtual instant that mean the control plane loops


@dataclass(frozen=True, slots=True)
class SimSpec:
    """What the driver models; ``pivotrl.sim.run.build`` makes one from a job config."""

    devices: int  # model instances
    tp: int  # GPUs per instance
    costs: CostModel
    policy: ModelSpec
    genrm: ModelSpec
    lengths: LengthDist  # policy response lengths (each request's max_new_tokens caps them too)
    seed: int  # the job's seed, mixed into every draw
    prompt_len: int  # tokens of every policy prompt (the problems are stand-ins)
    max_batch: int  # sequences an engine holds at most (rollout.max_batch); KV memory may allow fewer
    rollout_context: int  # the longest policy sequence, prompt and response: the size of a KV slot
    judge_context: int  # the longest judge sequence
    judge_template_len: int  # judge prompt tokens beside the question and the response
    judge_lengths: LengthDist  # tokens of a judgment, capped at judge.max_new_tokens
    yes_probability: float  # chance that a response is right (and is judged right)
    verdicts: tuple[str, str]  # judgment of a wrong and of a right response (parsed by the job's GenRM)
    slice_s: float = 5.0
    group_correlation: float = 0.0  # of the lengths of one prompt's responses (``workload.correlated``)
    replay: dict[tuple[int, int], int] | None = None  # (step, uid) -> a recorded length, replayed where given
    react_s: float = 0.0  # events within this long of the first are handled together, at the last one's time
    paged: bool = False  # engines page their KV cache (``sim.kv_cache``); else each sequence reserves its longest
    # the mean context of a decode step of each role: what a sequence holds in a paged cache on average
    rollout_decode_context: float = 0.0
    judge_decode_context: float = 0.0
    # GPUs of each engine of a rollout and of a judge instance (0: one engine of the instance's ``tp``)
    engine_tp: tuple[int, int] = (0, 0)
    elastic: bool = False  # engines take the fastest layout of each decode span, for free: a bound (``layout``)
    # the trainer backpropagates every group at the optimizer step, in lockstep over its instances (FSDP2,
    # ``train.backend=fsdp``); else each group on its own as it is handed out (``zero``, ``replicated``)
    lockstep_train: bool = False
    _role_costs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def role_costs(self, role: Role) -> CostModel:
        """What an instance costs in ``role``: ``costs`` over its engines' layout (training: ``costs``)."""
        out = self._role_costs.get(role)
        if out is None:
            out = self.costs
            if role is not Role.TRAIN:
                out = role_costs(self.costs, self.tp, self.engine_tp[role is Role.JUDGE], self.elastic,
                                 self.max_batch)  # fmt: skip
            self._role_costs[role] = out
        return out

    def engines(self, role: Role) -> int:
        """Engines an instance of ``role`` runs (each of ``max_batch`` slots)."""
        costs = self.role_costs(role)
        return costs.engines if isinstance(costs, EngineLayout) else 1

    def kv_tokens(self, role: Role) -> int | None:
        """Tokens of paged KV cache an instance of ``role`` holds; None where sequences hold fixed slots."""
        if not self.paged:
            return None
        return self.role_costs(role).kv_tokens(self.policy if role is Role.ROLLOUT else self.genrm, self.tp)

    @property
    def judge_shared_len(self) -> int:
        """Tokens a group's judge prompts begin with alike, which a paged judge cache (a prefix cache) reads once
        a group: the template and the question (and its reference) come before the response, as the default
        judge template has them. 0 where the cache is not paged."""
        return self.prompt_len + self.judge_template_len if self.kv_tokens(Role.JUDGE) is not None else 0

    def capacity(self, role: Role) -> int:
        """Sequences one instance of ``role`` runs at once: its engines' slots, or fewer if KV memory says
        so (elastic engines: the most of any of their layouts)."""
        rollout = role is Role.ROLLOUT
        model, context = (self.policy, self.rollout_context) if rollout else (self.genrm, self.judge_context)
        typical = self.rollout_decode_context if rollout else self.judge_decode_context
        costs = self.role_costs(role)
        layouts = costs.layouts(model) if isinstance(costs, EngineLayout) else ((self.tp, 1, None),)
        return max(self._held(model, g, k, context, typical) for g, k, _ in layouts)

    def _held(self, model: ModelSpec, tp: int, engines: int, context: int, typical: float) -> int:
        """Sequences ``engines`` engines of ``tp`` GPUs hold: their slots, or fewer if KV memory says so. A
        paged cache holds as many as fit at the role's mean decode context, or none if its longest
        sequence does not fit alone in one engine."""
        slots, kv = self.max_batch * engines, self.costs.kv_tokens(model, tp) if self.paged else None
        if kv is None:
            return min(slots, engines * self.costs.max_batch(model, tp, context))
        if kv < context:
            return 0
        return min(slots, max(1, math.floor(engines * kv / max(typical, 1.0))))


@dataclass(slots=True)
class _Slice:
    start: float
    grid: float  # where it ends unless the engine runs dry first
    running: int  # engine load when it started
    tokens: int  # engine counters when it started
    prefill_tokens: int
    prefill_seconds: float
    steps: int  # engine decode steps when it started
    kv_read: float  # engine context tokens read when it started
    anchor: tuple = ()  # engine snapshot the current plan starts from
    done: list[SimSeq] = field(default_factory=list)  # finished before the anchor
    planned: list[SimSeq] = field(default_factory=list)  # finished between the anchor and the end
    end: float = 0.0
    epoch: int = 0


@dataclass(slots=True)
class _Device:
    id: int
    role: Role | None = None
    version: int = -1
    free_at: float = 0.0  # a shift or training work runs until then
    engine: ModeledEngine | None = None
    slice: _Slice | None = None  # the generation slice in flight


class SimDriver:
    """``spec.devices`` modeled instances answering the control plane's commands on a virtual clock."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.now = 0.0
        self.devices = [_Device(d) for d in range(spec.devices)]
        self._preempted = 0  # of engines already replaced (``preemptions`` adds those in service)
        self._heap: list[tuple[float, int, Callable[[], list[Event]]]] = []
        self._seq = 0  # tie-break: same-time completions come out in the order they were scheduled
        self._to_start: set[int] = set()  # devices whose engine has work and no slice in flight
        self._slices: list[Slice] = []
        self._rounds = 0  # rounds of commands since virtual time last moved
        self._recent: deque[Command] = deque(maxlen=6)  # the latest commands, for the livelock message
        self._last: dict[int, Slice] = {}  # each device's latest slice, extended while its role work runs on
        self._placeholders: dict[tuple[int, type], list] = {}  # placeholder ids and logprobs, shared per length
        # (seed, uid) -> the draw of a response to judge (evaluation responses are not judged: a few hundred stay)
        self._judged_right: dict[tuple[int, int], bool] = {}
        self._spreads = {kind: spec.costs.spread(kind) for kind in SPREAD_KINDS}
        self._drawn_count: dict[tuple[str, int], int] = {}  # (kind, device) -> operations of the kind drawn on it
        self._train_set: tuple[int, ...] = ()  # the devices of the last optimizer step: their group is kept
        self._buffered: dict[int, list[int]] = {}  # lockstep: device -> [samples, tokens] handed to it this step

    # -- the driver interface -------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def start_clock(self, origin: float) -> None:
        """Virtual time starts at 0 whatever the wall clock says."""

    def preemptions(self) -> int:
        """Sequences sent back to their engine's queue because its paged cache was full, so far."""
        return self._preempted + sum(d.engine.preempted for d in self.devices if d.engine is not None)

    def slices(self) -> list[Slice]:
        out, self._slices, self._last = self._slices, [], {}
        return out

    def close(self) -> None:
        pass

    def submit(self, cmd: Command) -> None:
        self._recent.append(cmd)  # (named only if the message is written: 10^5 commands a run)
        if isinstance(cmd, Shift):
            self._shift(cmd)
        elif isinstance(cmd, Generate):
            dev = self._generation_device(cmd.device, Role.ROLLOUT)
            if dev.version != cmd.version:
                raise RuntimeError(f"device {dev.id} holds policy v{dev.version}, requests need v{cmd.version}")
            self._add(dev, [self._gen_seq(r, cmd.version) for r in cmd.requests])
        elif isinstance(cmd, Judge):
            self._add(self._generation_device(cmd.device, Role.JUDGE), [self._judge_seq(r) for r in cmd.requests])
        elif isinstance(cmd, Abort):
            self._abort(self.devices[cmd.device], set(cmd.uids))
        elif isinstance(cmd, Accumulate):
            self._accumulate(cmd)
        elif isinstance(cmd, Step):
            self._step(cmd)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def next_events(self) -> list[Event]:
        out: list[Event] = []
        while not out:
            self._start_slices()
            if not self._heap:
                raise StallError("the controller waits for events but no device has work")
            t = self._heap[0][0]
            self._rounds = self._rounds + 1 if t <= self.now else 0
            if self._rounds > LIVELOCK_ROUNDS:
                raise StallError(
                    f"the control plane repeats itself without progress: {LIVELOCK_ROUNDS} rounds of commands at "
                    f"t={self.now:.3f} s, the latest {', '.join(map(_named, self._recent))}"
                )
            # what completes within the control plane's reaction time is handled as one batch when the
            # last of it lands: a cluster's devices finish at distinct instants, thousands a step
            until = t + min(self.spec.react_s, self.spec.slice_s / 2)
            while self._heap and self._heap[0][0] <= until:
                t, _, fn = heapq.heappop(self._heap)
                self.now = max(self.now, t)
                out += fn()
        return out

    # -- scheduling -----------------------------------------------------------------
    def _at(self, t: float, fn: Callable[[], list[Event]]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def _record(self, device: int, role: str, name: str, start: float, end: float, **args: float) -> Slice:
        s = Slice(device, role, name, start, end, dict(args))
        self._slices.append(s)
        self._last[device] = s
        return s

    def _drawn(self, seconds: float, kind: str, device: int) -> float:
        """The seconds one operation of ``kind`` on ``device`` takes: drawn about ``seconds`` with the
        cost model's spread for it (lognormal, of mean ``seconds``), or exactly ``seconds`` where it has
        none. The draw is fixed by the job's seed, the device and how many of the kind it ran before, so
        a change elsewhere in the job does not reshuffle every later operation's draw."""
        cv = self._spreads[kind]
        if not cv or seconds <= 0:
            return seconds
        key = (kind, device)
        n = self._drawn_count[key] = self._drawn_count.get(key, 0) + 1
        u = synthetic.unit(self.spec.seed, device, n, SPREAD_KINDS.index(kind), synthetic.SPREAD)
        var = math.log1p(cv * cv)
        return seconds * math.exp(math.sqrt(var) * normal_score(u) - var / 2)

    # -- shifts and training --------------------------------------------------------
    def _shift(self, cmd: Shift) -> None:
        dev, spec = self.devices[cmd.device], self.spec
        if dev.engine is not None and dev.engine.has_work or dev.slice is not None:
            raise RuntimeError(f"device {dev.id}: shift to {cmd.role.value} with sequences in flight")
        model = spec.genrm if cmd.role is Role.JUDGE else spec.policy
        src, costs = dev.role, spec.role_costs(cmd.role)
        if src is cmd.role is Role.ROLLOUT:
            seconds = costs.refresh(model, spec.tp)
        elif src is cmd.role is Role.TRAIN:  # the runtime rebuilds a trainer to change its version
            seconds = costs.shift(model, None, Role.TRAIN, spec.tp)
        else:
            seconds = costs.shift(model, src, cmd.role, spec.tp)
        seconds = self._drawn(seconds, "shift", dev.id)
        # the weights; a trainer's optimizer shard comes at its optimizer step (``CostModel.optimizer_step``)
        nbytes = 0 if src is cmd.role is Role.JUDGE else int(model.weight_bytes)
        t0 = max(self.now, dev.free_at)
        dev.free_at = t1 = t0 + seconds

        def done() -> list[Event]:
            dev.role, dev.version, old = cmd.role, cmd.version, dev.engine
            if cmd.role is Role.TRAIN:
                dev.engine = None
            elif src is not cmd.role or dev.engine is None:
                kv = spec.kv_tokens(cmd.role)  # paged: as many sequences as the engine's slots and its cache allow
                slots = spec.max_batch * spec.engines(cmd.role) if kv is not None else spec.capacity(cmd.role)
                dev.engine = ModeledEngine(costs, model, spec.tp, slots, t1, kv)
            if old is not None and dev.engine is not old:  # its preemptions outlive it
                self._preempted += old.preempted
            name = f"{src.value if src else 'none'}->{cmd.role.value}"
            self._record(dev.id, "shift", name, t0, t1, bytes=nbytes, version=cmd.version)
            return [ShiftDone(dev.id, cmd.role, cmd.version, seconds, nbytes)]

        self._at(t1, done)

    def _train_device(self, device: int, version: int) -> _Device:
        dev = self.devices[device]
        if dev.role is not Role.TRAIN:
            raise RuntimeError(f"device {device} is not in the train role")
        if dev.version != version:
            raise RuntimeError(f"device {device} holds policy v{dev.version}, update needs v{version}")
        return dev

    def _accumulate(self, cmd: Accumulate) -> None:
        dev, spec, shard = self._train_device(cmd.device, cmd.version), self.spec, cmd.shard
        samples = len(shard.response_ids)
        response = sum(len(r) for r in shard.response_ids)
        tokens = response + sum(len(p) for p in shard.prompt_ids)
        if spec.lockstep_train:  # buffered until the step, as FSDP2's worker does (it reports no tokens)
            held = self._buffered.setdefault(dev.id, [0, 0])
            held[0] += samples
            held[1] += tokens
            self._at(max(self.now, dev.free_at), lambda: [Accumulated(dev.id, samples, 0, 0.0)])
            return
        seconds = spec.costs.train_tokens(spec.policy, tokens, spec.tp, round(tokens / max(samples, 1)))
        seconds = self._drawn(seconds, "accumulate", dev.id)
        t0 = max(self.now, dev.free_at)
        dev.free_at = t1 = t0 + seconds

        def done() -> list[Event]:
            self._record(dev.id, "train", f"accumulate {samples}", t0, t1, tokens=tokens)
            return [Accumulated(dev.id, samples, tokens, seconds)]

        self._at(t1, done)

    def _step(self, cmd: Step) -> None:
        devs, spec = [self._train_device(d, cmd.version) for d in cmd.devices], self.spec
        seconds = self._drawn(spec.costs.optimizer_step(spec.policy, len(devs) * spec.tp), "optimizer", devs[0].id)
        if tuple(cmd.devices) != self._train_set:  # another set than the last step's: a new group meets first
            seconds += spec.costs.regroup(spec.policy, len(devs) * spec.tp)
            self._train_set = tuple(cmd.devices)
        backward, tokens = 0.0, 0
        if spec.lockstep_train:  # every buffered sample, dealt evenly by tokens over the step's instances
            samples = sum(self._buffered.get(d, (0, 0))[0] for d in cmd.devices)
            tokens = sum(self._buffered.get(d, (0, 0))[1] for d in cmd.devices)
            self._buffered.clear()
            if tokens:
                share = -(-tokens // len(devs))
                backward = spec.costs.train_tokens(spec.policy, share, spec.tp, round(tokens / max(samples, 1)))
                backward = self._drawn(backward, "accumulate", devs[0].id)
                seconds += backward
        t0 = max([self.now] + [d.free_at for d in devs])
        t1 = t0 + seconds
        for d in devs:
            d.free_at = t1
        new = cmd.version + 1
        stats = {"tokens": float(cmd.total_tokens), "world_size": float(len(devs)), "version": float(new)}

        def done() -> list[Event]:
            for d in devs:
                d.version = new
                if backward:  # (FSDP2: the step's backward, in lockstep, then the update)
                    self._record(d.id, "train", "backward in lockstep", t0, t0 + backward, tokens=tokens)
                self._record(d.id, "train", f"step v{cmd.version}->v{new}", t0 + backward, t1)
            return [Trained(cmd.devices, new, stats, seconds, tokens, backward)]

        self._at(t1, done)

    # -- generation -----------------------------------------------------------------
    def _generation_device(self, device: int, role: Role) -> _Device:
        dev = self.devices[device]
        if dev.role is not role or dev.engine is None:
            have = dev.role.value if dev.role else "no role"
            raise RuntimeError(f"device {device} holds {have}, cannot serve {role.value} requests")
        return dev

    def _gen_seq(self, r: GenRequest, version: int) -> SimSeq:
        spec = self.spec
        u = synthetic.unit(spec.seed, r.seed, r.uid, synthetic.LENGTH)
        if spec.group_correlation:  # a group is the responses to one prompt for one policy version
            group = synthetic.unit(spec.seed, version, zlib.crc32(r.prompt.encode()), synthetic.GROUP_LENGTH)
            u = correlated(group, u, spec.group_correlation)
        target = spec.lengths.quantile(u)
        if spec.replay is not None:  # a step's requests carry the version before its update: step - 1
            target = max(1, spec.replay.get((version + 1, r.uid), target))
        target = min(target, r.params.max_new_tokens)
        prompt = len(r.prompt_ids) or self.spec.prompt_len
        return SimSeq(r.uid, prompt, len(r.output_ids), target, r)

    def _judge_seq(self, r: JudgeRequest) -> SimSeq:
        spec = self.spec
        if r.prompt_ids:
            prompt = len(r.prompt_ids)
        else:
            prompt = spec.prompt_len + synthetic.response_tokens(r.response) + spec.judge_template_len
        u = synthetic.unit(spec.seed, r.seed, r.uid, synthetic.JUDGE_LENGTH)
        target = min(spec.judge_lengths.quantile(u), r.params.max_new_tokens)
        return SimSeq(r.uid, prompt, len(r.output_ids), target, r, group=r.group,
                      shared=spec.judge_shared_len if r.group >= 0 else 0)  # fmt: skip

    def _add(self, dev: _Device, seqs: list[SimSeq]) -> None:
        engine = dev.engine
        assert engine is not None
        if dev.slice is not None:  # mid-slice: back to now, then plan the rest with the newcomers
            self._catch_up(dev)
        for s in seqs:
            engine.add(s, self.now)
        if dev.slice is not None:
            self._plan(dev)
        elif seqs:
            self._to_start.add(dev.id)

    def _grid_after(self, t: float) -> float:
        s = self.spec.slice_s
        end = (math.floor(t / s + 1e-9) + 1) * s
        return end + s if end - t < s / 2 else end

    def _start_slices(self) -> None:
        for d in sorted(self._to_start):
            dev = self.devices[d]
            engine = dev.engine
            if dev.slice is None and engine is not None and engine.has_work:
                engine.peak = 0
                dev.slice = _Slice(self.now, self._grid_after(self.now), engine.load, engine.tokens,
                                   engine.prefill_tokens, engine.prefill_seconds, engine.k, engine.kv_read)  # fmt: skip
                self._plan(dev)
        self._to_start.clear()

    def _plan(self, dev: _Device) -> None:
        """Advance the engine to the slice's end and schedule the report there (or where it runs dry)."""
        s, engine = dev.slice, dev.engine
        assert s is not None and engine is not None
        s.anchor = engine.snapshot()
        s.planned = engine.advance(s.grid)
        s.end = s.grid if engine.has_work else min(s.grid, max(engine.t, self.now))
        s.epoch = self._seq + 1  # unique: a report scheduled for an older plan (or slice) is void
        self._at(s.end, partial(self._end_slice, dev, s.epoch))

    def _catch_up(self, dev: _Device) -> None:
        """Take the slice's plan back to now: only what completed by now has happened."""
        s, engine = dev.slice, dev.engine
        assert s is not None and engine is not None
        engine.restore(s.anchor)
        s.done += engine.advance(self.now)
        s.planned, s.epoch = [], -1  # the scheduled report is void

    def _end_slice(self, dev: _Device, epoch: int) -> list[Event]:
        s = dev.slice
        if s is None or s.epoch != epoch:
            return []
        events = self._report(dev, s, s.end, s.done + s.planned)
        dev.slice = None
        if dev.engine is not None and dev.engine.has_work:
            self._to_start.add(dev.id)
        return events

    def _report(self, dev: _Device, s: _Slice, end: float, done: list[SimSeq]) -> list[Event]:
        """The slice's Progress and results, as ``Worker.run`` returns them."""
        engine, role = dev.engine, dev.role
        assert engine is not None and role is not None
        tokens = engine.tokens - s.tokens
        so_far = engine.so_far()
        prefill = (engine.prefill_tokens - s.prefill_tokens, engine.prefill_seconds - s.prefill_seconds)
        steps, kv = engine.k - s.steps, round(engine.kv_read - s.kv_read)
        events: list[Event] = [Progress(dev.id, role, end - s.start, tokens, s.running, so_far, *prefill, steps, kv)]
        if done and role is Role.ROLLOUT:
            events.append(Generated(dev.id, tuple(self._gen_result(q, dev.version) for q in done)))
        elif done:
            events.append(Judged(dev.id, tuple(self._judge_result(q) for q in done)))
        last, kind = self._last.get(dev.id), role.value  # (an enum's value is a descriptor call: read it once)
        if last is not None and last.role == kind and last.end == s.start:  # one bar while the work runs on
            last.end = end
            args = last.args
            args["finished"] += len(done)
            args["tokens"] += tokens
            args["batch"] = max(args["batch"], engine.peak)
            last.name = f"{kind} {args['finished']} done"
        else:
            name = f"{kind} {len(done)} done"
            self._record(dev.id, kind, name, s.start, end, finished=len(done), tokens=tokens, batch=engine.peak)
        return events

    def _placeholder(self, n: int, value: float = 0) -> list:
        """``n`` placeholder token ids (or logprobs, ``value=0.0``), read-only: every result of this
        length shares the list (a step's responses would otherwise allocate 10^7 of them)."""
        key = (n, type(value))
        ids = self._placeholders.get(key)
        if ids is None:
            ids = self._placeholders[key] = [value] * n
        return ids

    def _gen_result(self, q: SimSeq, version: int) -> GenResult:
        r: GenRequest = q.request
        right = self._right(r.seed, r.uid)
        self._judged_right[(r.seed, r.uid)] = right  # the judgment of this response draws the same
        reason = "length" if q.target >= r.params.max_new_tokens else "stop"
        text = synthetic.response_text(q.target, right)
        ids, logprobs = self._placeholder(q.target), self._placeholder(q.target, 0.0)
        return GenResult(r.uid, self._placeholder(q.prompt), ids, logprobs, text, reason, version)

    def _right(self, seed: int, uid: int) -> bool:
        """Whether the response to sequence ``uid`` is right: one draw for its text and its judgment."""
        return synthetic.unit(self.spec.seed, seed, uid, synthetic.VERDICT) < self.spec.yes_probability

    def _judge_result(self, q: SimSeq) -> JudgeResult:
        r: JudgeRequest = q.request
        right = self._judged_right.pop((r.seed, r.uid), None)
        if right is None:  # (a judge request that no generation here answered)
            right = self._right(r.seed, r.uid)
        truncated = q.target >= r.params.max_new_tokens  # cut off before its verdict: the GenRM's fallback
        return JudgeResult(r.uid, "" if truncated else self.spec.verdicts[right], truncated, q.target)

    # -- abort ----------------------------------------------------------------------
    def _abort(self, dev: _Device, uids: set[int]) -> None:
        """Everything in flight (or the requests of ``uids`` still in flight) comes back with its
        tokens so far (``Worker.abort``'s shape). A device keeping work goes on with its slice."""
        events: list[Event] = []
        if dev.slice is not None:  # the slice ends here: what finished before now is reported first
            self._catch_up(dev)
            if self.now > dev.slice.start or dev.slice.done:
                events += self._report(dev, dev.slice, self.now, dev.slice.done)
            dev.slice = None
        self._to_start.discard(dev.id)
        engine = dev.engine
        taken = [] if engine is None else engine.take(uids) if uids else engine.take_all()
        if engine is not None and engine.has_work:  # what it keeps runs on in a new slice
            self._to_start.add(dev.id)
        gen: list[GenRequest] = []
        judge: list[JudgeRequest] = []
        for q, n in taken:
            r = q.request
            if isinstance(r, GenRequest):
                gen.append(replace(r, prompt_ids=self._placeholder(q.prompt), output_ids=self._placeholder(n),
                                   logprobs=self._placeholder(n, 0.0)))  # fmt: skip
            else:
                judge.append(replace(r, prompt_ids=(0,) * q.prompt, output_ids=(0,) * n))
        if gen or judge:
            role = dev.role.value if dev.role else "idle"
            self._record(dev.id, "migrate", f"abort {len(gen) + len(judge)} {role}", self.now, self.now)
        events.append(Aborted(dev.id, tuple(gen), tuple(judge), 0.0))
        self._at(self.now, lambda: events)
