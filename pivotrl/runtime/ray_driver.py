"""Ray driver: one actor per device (``pivotrl.runtime.device_actor``), the control plane's commands on
instances mapped to their devices (``pivotrl.runtime.instances``).

The embedded default starts a local Ray instance of its own (no dashboard,
token auth), whatever else runs on the machine; ``ray_address`` joins an
existing cluster instead (``ray start --head`` then ``--ray-address auto``).
Each device actor holds one bundle of a placement group packed per node (a
GPU share when devices are cuda; see ``pivotrl.runtime.devices``), and the
instances are cut from each node's devices. Weights travel through the GPS
in Ray's object store. A device generates on its own while it holds
sequences: the driver keeps one look (``run``) in flight per generating
instance and turns what each returns into events, so rewards stream;
commands (a shift, an abort, more work) run between two slices.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pivotrl import gps_sizing
from pivotrl.config import JobConfig
from pivotrl.control.controller import DeviceLostError
from pivotrl.control.drive import StallError
from pivotrl.control.messages import (
    Abort,
    Accumulate,
    Command,
    DeviceJoined,
    DeviceLost,
    Event,
    Generate,
    Judge,
    Shift,
    Step,
    StepFailed,
)
from pivotrl.errors import UserError
from pivotrl.gps import RayStore
from pivotrl.log import logger
from pivotrl.resolve import Plan
from pivotrl.runtime import devices as dev
from pivotrl.runtime.blame import PROBE_S, blame, told
from pivotrl.runtime.contexts import POLICY, ContextSpec
from pivotrl.runtime.device_actor import PROBE, DeviceActor
from pivotrl.runtime.engine_host import (
    engine_processes,
)
from pivotrl.runtime.groups import TrainGroups
from pivotrl.runtime.instances import Instances, combine_accumulated, combine_shifts, split_shard
from pivotrl.runtime.ray_session import clean_stale_sessions, mark_session, unmark_session
from pivotrl.runtime.worker import TrainSpec
from pivotrl.telemetry import Slice
from pivotrl.train.group import collective_timeout

POLL_S = 1.0  # how long a look at a generating device waits for its next slice's events (it returns with them)
STEP_GRACE_S = 20.0  # how long the rest of an optimizer step may take once one of its devices is lost
PLACEMENT_TIMEOUT_S = 60.0  # how long the cluster may take to reserve every device's bundle
START_TIMEOUT_S = 300.0  # how long device actors may take to start, at least (device_timeout bounds calls)


def start_timeout(device_timeout: float) -> float:
    """The bound on a device actor's start: a start is a process and its imports, not a call."""
    return max(device_timeout, START_TIMEOUT_S)


@dataclass(slots=True)
class _Gather:
    """The calls of one command sent to every device of an instance, until every one has returned: one event."""

    instance: int
    combine: Callable[[list[Any]], Event]
    refs: dict[Any, int]  # ObjectRef -> rank in the instance, still out
    results: list[tuple[int, Any]] = field(default_factory=list)  # (rank in the instance, its event)


@dataclass(slots=True)
class _StepCalls:
    """The calls of one optimizer step, until every one has returned."""

    devices: tuple[int, ...]  # the step's instances (the control plane's devices)
    version: int
    refs: dict[Any, int] = field(default_factory=dict)  # ObjectRef -> device (of the job's), still out
    trained: Any = None  # rank 0's Trained, once returned
    lost: list[DeviceLost] = field(default_factory=list)
    lost_at: float = 0.0  # when the first member was lost (monotonic)
    rendezvous: Any = None  # rank 0's (host, port) of a new group (an ObjectRef for several); None: the held one
    attempt: int = 0  # the driver's count of optimizer steps sent, this one's (a member is told which to abandon)
    errors: list[BaseException] = field(default_factory=list)


def check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody answers at: ray.init retries such an address for minutes."""
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit():
        try:
            socket.create_connection((host.removeprefix("ray://"), int(port)), timeout=5).close()
        except OSError as e:
            raise UserError(f"--ray-address {address}: nothing answers there ({e.strerror or e})") from None


def _join_cluster(address: str, kwargs: dict[str, Any]) -> None:
    """Join an existing cluster, with its token when one is at hand (see ``devices.enable_cluster_token``;
    the CLI enables it before ray is imported, which covers a client of any Ray version)."""
    import ray

    dev.enable_cluster_token()
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[-1][:300]
        raise UserError(
            f"--ray-address {address}: cannot join the Ray cluster ({reason}); start it with `ray start --head` "
            "and, if it uses token auth, make its token available (~/.ray/auth_token or RAY_AUTH_TOKEN)"
        ) from None


def _place(kind: dev.Kind, cfg: JobConfig, address: str | None) -> Any:
    """Reserve one bundle per device, packed per node; a clear error when the cluster cannot hold them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = dev.bundles(kind, cfg.devices, cfg.gpus_per_device)
    where = f"the Ray cluster at {address}" if address else "the local Ray instance"
    ask = f"devices={cfg.devices}" + (f", gpus_per_device={cfg.gpus_per_device:g}" if kind == dev.CUDA else "")
    total = ray.cluster_resources()
    short = dev.shortfall(wanted, total)
    if short:
        need = ", ".join(f"{sum(b.get(k, 0) for b in wanted):g} {k}" for k in short)
        has = ", ".join(f"{total.get(k, 0):g} {k}" for k in short)
        lower = "devices or gpus_per_device" if "GPU" in short else "devices"
        raise UserError(f"{ask}: {where} has {has}, the devices need {need}; lower {lower}")
    pg = placement_group(wanted, strategy="PACK", name=f"pivotrl-devices-{uuid.uuid4().hex[:8]}")
    logger.info("waiting for %d device bundles of %s on %s", cfg.devices, wanted[0], where)
    if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        remove_placement_group(pg)
        raise UserError(
            f"{ask}: {where} could not place {cfg.devices} bundles of {wanted[0]} within "
            f"{PLACEMENT_TIMEOUT_S:g} s (each must fit on one node, beside what else runs there); "
            "lower devices or gpus_per_device"
        )
    return pg


def _threads(pg: Any, cfg: JobConfig, local: bool) -> list[int]:
    """Torch threads per device: see ``devices.thread_shares``. A local instance's node is this machine
    (its declared CPUs are only a scheduling budget); a cluster node has the CPUs it declares."""
    import ray

    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    nodes = [table[d] for d in range(cfg.devices)]
    if local:
        cores = dict.fromkeys(nodes, dev.machine_cores())
    else:
        cores = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n["Alive"]}
    return dev.thread_shares(nodes, cores, cfg.threads_per_device)


def _instances(size: int, pg: Any, devices: int) -> Instances:
    """The job's devices in instances of ``size``, each on one node (an engine's ranks meet there, and a node's
    GPUs are linked), as the placement group put them; one line naming ``tensor_parallel`` where a node's devices
    are not a whole number of instances."""
    if size == 1:
        return Instances.uniform(1, devices)
    import ray

    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    try:
        return Instances.on_nodes(size, [table[d] for d in range(devices)])
    except ValueError as e:
        raise UserError(
            f"tensor_parallel={size}: {e}; use a tensor_parallel that divides every node's devices"
        ) from None


def _keep_versions(cfg: JobConfig) -> int:
    """The policy versions the GPS keeps, as the devices' train spec says."""
    return TrainSpec(cfg.train, cfg.rollout.temperature).keep_versions


class RayDriver:
    def __init__(
        self, cfg: JobConfig, spec_for: Callable[[str], ContextSpec], origin: float, address: str | None = None
    ) -> None:
        """Device actors on the cluster at ``address`` (None: a Ray instance of this process's own); ``spec_for``
        builds their context spec for the kind of device the cluster has (what it resolves: the rollout's
        dtype, whether devices share a GPU and so which trainer they run), once that is known."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if address is not None:
            check_reachable(address)
        self.started_ray = not ray.is_initialized()
        self.session_dir: str | None = None  # that of the instance this driver started and marked as its own
        self.store: RayStore | None = None
        self.object_store: gps_sizing.ObjectStore | None = None
        self.actors: list[Any] = []
        self.pg: Any = None
        # the driver's books are in instances (the control plane's devices; the job's devices where
        # tensor_parallel is 1); a call names its device where it went to one of an instance's several
        self.pending: dict[Any, tuple[str, int]] = {}  # ObjectRef -> (kind, instance)
        self.sent: dict[Any, float] = {}  # ObjectRef -> when it was sent (device_timeout counts from there)
        self.lost: set[int] = set()  # instances lost and not back yet
        self.gathers: dict[Any, _Gather] = {}  # ObjectRef -> the instance-wide command it is part of
        self.joining: dict[Any, int] = {}  # ObjectRef of a restarted device's first answer -> the device
        if self.started_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False, "log_to_driver": True}
            if address is None:  # our own instance, never one that runs beside us. (Ray 2.60 turns the loopback
                # node address into the machine's own and listens on all interfaces; the token auth it turns on
                # for a local instance is what guards it.)
                clean_stale_sessions()
                gpus = dev.local_gpus() if cfg.device != dev.CPU else 0
                # the object store sized from what the GPS will hold, preallocated (see pivotrl.gps_sizing)
                held = gps_sizing.for_job(cfg, dev.resolve(cfg.device, gpus), _keep_versions(cfg))
                self.object_store, store_kwargs = gps_sizing.local_store(held)
                ray.init(address="local", num_cpus=max(2, cfg.devices), num_gpus=gpus, _node_ip_address=dev.LOOPBACK,
                         **store_kwargs, **kwargs)  # fmt: skip
                self.session_dir = ray._private.worker._global_node.get_session_dir_path()
                mark_session(self.session_dir)
            else:
                _join_cluster(address, kwargs)
        try:
            where = f"the Ray cluster at {address}" if address else "this machine"
            self.kind = dev.resolve(cfg.device, ray.cluster_resources().get("GPU", 0.0), where)
            self.pg = _place(self.kind, cfg, address)
            if self.object_store is None:  # a cluster's store: checked against what the GPS will hold
                held = gps_sizing.for_job(cfg, self.kind, _keep_versions(cfg))
                self.object_store = gps_sizing.joined_store(held, self.pg, cfg.devices, where)
            threads = _threads(self.pg, cfg, local=address is None)
            self.store = RayStore.create(f"pivotrl-gps-{uuid.uuid4().hex[:8]}")
            self.spec = spec_for(self.kind)  # (configure gives it the plan's dtypes and backends)
            self.train = TrainSpec(
                cfg.train, cfg.rollout.temperature, collective_timeout_s=collective_timeout(cfg.device_timeout)
            )  # (configure makes it concrete)
            # each of a device's processes (its own, its engines') holds an equal share of its bundle's GPU
            processes = engine_processes(cfg.rollout.backend, cfg.judge.backend, self.kind)
            share = dev.process_share(cfg.gpus_per_device, processes) if self.kind == dev.CUDA else 0

            def start(d: int) -> Any:
                where_d = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=d)
                remote = ray.remote(concurrency_groups={PROBE: 1})(DeviceActor)
                actor = remote.options(num_cpus=1, num_gpus=share, scheduling_strategy=where_d)
                return actor.remote(
                    d, self.store, self.spec, self.train, self.origin, threads[d], d, share, self.inst.member(d)
                )

            self.origin, self._start = origin, start
            self.inst = Instances.uniform(1, cfg.devices)  # (configure makes them the plan's)
            self.actors = [start(d) for d in range(cfg.devices)]
            # every wait on a device is bounded: an actor that cannot start (no resources, a broken node) is an
            # error, not a hang. A start (a process, its imports) is not a call: on a loaded machine it takes far
            # longer than a short device_timeout set for calls, so it has a bound of its own
            wait = start_timeout(cfg.device_timeout)
            try:
                self.bindings: list[dev.Binding] = ray.get([a.binding.remote() for a in self.actors], timeout=wait)
            except ray.exceptions.GetTimeoutError:
                raise UserError(
                    f"the {cfg.devices} device actors did not start within {wait:g} s (the longer of "
                    f"device_timeout={cfg.device_timeout:g} and {START_TIMEOUT_S:g} s; are the resources they ask "
                    "for free on the cluster?)"
                ) from None
            dev.check_bindings(cfg.device, self.kind, self.bindings)
            self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=wait)
        except BaseException:
            self.close()
            raise
        self.running: set[int] = set()  # devices with a look (run()) in flight
        self.dirty: set[int] = set()  # devices given work since their run() was sent
        self.lost_events: list[Event] = []
        self.timeout, self.restart = cfg.device_timeout, cfg.restart_lost
        self.fault = cfg.fault if cfg.fault.device >= 0 or cfg.fault.first else None
        self.version = 0  # the newest policy version a command named (the step of a Judge: it names none)
        self.stepping: _StepCalls | None = None  # the optimizer step in flight
        self.attempts = 0  # optimizer steps sent so far (tries again included)
        # a sharded trainer's step that loses a member cannot be saved: the run stops at once (see the controller)
        self.sharded = False  # (configure says, from the job's plan)
        self.groups = TrainGroups()
        if self.kind == dev.CUDA and any(b.kind != dev.CUDA for b in self.bindings):
            logger.warning("device actors hold GPU shares but their torch sees no CUDA: they compute on the CPU")
        for b in self.bindings:
            logger.info(
                "device %d: %s on %s, bundle %s, GPU %s, %d threads",
                b.device, b.kind, b.node_ip, b.bundle, ",".join(b.gpu_ids) or "-", b.threads,
            )  # fmt: skip

    def configure(self, plan: Plan) -> None:
        """Every device's train config, dtypes and backends as the job resolved them once the devices were known
        (a device restarted later starts with them), and whether a lost train device loses state no other holds."""
        import ray

        self.sharded = plan.traits.unique_state
        self.train = replace(self.train, cfg=plan.train)
        self.spec = replace(self.spec, **plan.serving())
        self.inst = _instances(plan.tensor_parallel, self.pg, len(self.actors))
        refs = [a.configure.remote(plan, self.inst.member(d)) for d, a in enumerate(self.actors)]
        ray.get(refs, timeout=self.timeout)

    def start_clock(self, origin: float) -> None:
        """Wait until every device actor is up, then share the run clock's origin."""
        import ray

        self.origin = origin
        ray.get([a.set_origin.remote(origin) for a in self.actors], timeout=self.timeout)

    def submit(self, cmd: Command) -> None:
        devices = cmd.devices if isinstance(cmd, Step) else (cmd.device,)
        if any(d in self.lost for d in devices):  # sent before its loss reached the controller: void
            logger.warning("ray driver: %s for a lost device dropped", type(cmd).__name__)
            return
        if hasattr(cmd, "version"):
            self.version = max(self.version, cmd.version)
        self._inject(cmd, devices, before=True)
        first = self.actors[self.inst.first(devices[0])]
        if isinstance(cmd, Shift):
            members = self.inst.members(cmd.device)
            self._gather([self.actors[d].shift.remote(cmd.role, cmd.version) for d in members], cmd.device,
                         combine_shifts)  # fmt: skip
        elif isinstance(cmd, Generate | Judge):
            actor = first
            call = actor.generate if isinstance(cmd, Generate) else actor.judge
            self._send(call.remote(cmd), "ack", cmd.device)
            self.dirty.add(cmd.device)
            self._run(cmd.device)
        elif isinstance(cmd, Accumulate):  # (each device of the instance backpropagates its part of the groups)
            parts = split_shard(cmd.shard, self.inst.size)
            members = zip(self.inst.members(cmd.device), parts, strict=True)
            given = [(d, p) for k, (d, p) in enumerate(members) if k == 0 or p.advantages]
            refs = [self.actors[d].accumulate.remote(replace(cmd, shard=p)) for d, p in given]
            self._gather(refs, cmd.device, combine_accumulated)
        elif isinstance(cmd, Step):  # every device of the step's instances is a rank
            ranks = self.inst.ranks(cmd.devices)
            rendezvous, after = self.groups.plan(ranks, self._retire, self._listen)
            after = [a for a in after if a is not None]
            self.attempts += 1
            self.stepping = _StepCalls(cmd.devices, cmd.version, rendezvous=rendezvous, attempt=self.attempts)
            sent = replace(cmd, devices=ranks)
            for rank, d in enumerate(ranks):
                ref = self.actors[d].step.remote(sent, rank, rendezvous, self.groups.state_world, self.attempts, *after)
                self._send(ref, "step", self.inst.of(d))
                self.stepping.refs[ref] = d
            self.groups.stepped(ranks)
        elif isinstance(cmd, Abort):
            self._send(first.abort.remote(cmd.uids), "event", cmd.device)
        else:
            raise TypeError(f"unknown command {cmd!r}")
        self._inject(cmd, devices, before=False)

    def _send(self, ref: Any, kind: str, instance: int) -> None:
        self.pending[ref] = (kind, instance)
        self.sent[ref] = time.monotonic()

    def _gather(self, refs: list[Any], instance: int, combine: Callable[[list[Any]], Event]) -> None:
        """Calls of one command to the devices of ``instance`` (the first's first), answered as one event."""
        gather = _Gather(instance, combine, {ref: rank for rank, ref in enumerate(refs)})
        for ref in refs:
            self._send(ref, "gather", instance)
            self.gathers[ref] = gather

    def _inject(self, cmd: Command, devices: tuple[int, ...], before: bool) -> None:
        """``fault``: fail its device at the first command of its phase in its step (a hang is queued before
        the command, so the command waits behind it; a kill follows the command, which dies with the actor,
        except for a member of an optimizer step other than rank 0: killed before, it never meets the others,
        who wait for it at the rendezvous)."""
        f = self.fault
        if f is None or (not f.first and self.inst.of(f.device) not in devices):
            return
        ranks = self.inst.ranks(devices) if isinstance(cmd, Step) else ()
        early = f.kind == "hang" or (isinstance(cmd, Step) and not f.first and ranks.index(f.device) > 0)
        if early != before:
            return
        phase = {Generate: "rollout", Judge: "judge", Accumulate: "backward", Step: "optimizer", Shift: "shift"}
        if phase.get(type(cmd)) != f.phase or self.version + 1 != f.step:
            return
        import ray

        device = self.inst.first(devices[0]) if f.first else f.device
        self.fault = None
        logger.warning("fault injected: device %d %s at the %s of step %d", device, f.kind, f.phase, f.step)
        if f.kind == "hang" and isinstance(cmd, Step):  # inside the step, among the others, as a hung kernel
            ray.get(self.actors[device].hang_in_next_step.remote(), timeout=self.timeout)
            return
        if f.kind == "hang":
            self._send(self.actors[device].hang.remote(), "hang", self.inst.of(device))
            return
        if isinstance(cmd, Step) and self.stepping and isinstance(self.stepping.rendezvous, ray.ObjectRef):
            # the harder case: rank 0 has told its port, so the others find a closed end, not a failed argument
            ray.wait([self.stepping.rendezvous], timeout=self.timeout or None)
        ray.kill(self.actors[device], no_restart=True)

    def _retire(self, device: int) -> Any:
        if self.inst.of(device) in self.lost:
            return None
        return self.actors[device].retire_group.remote()

    def _listen(self, device: int, world_size: int) -> Any:
        # rank 0 binds its port before anyone is told it (a port found free and bound later can be taken in
        # between); the others' step calls get it as an argument, Ray resolving it before they run
        return self.actors[device].listen.remote(world_size)

    def _run(self, instance: int) -> None:
        if instance not in self.running:  # (one look in flight: the instance generates on its own meanwhile)
            self.running.add(instance)
            self._send(self.actors[self.inst.first(instance)].run.remote(POLL_S), "run", instance)
            self.dirty.discard(instance)

    def next_events(self) -> list[Event]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        out, self.lost_events = self.lost_events, []
        while not out:
            if not self.pending:
                if self.lost:  # nothing left to run the job (devices lost and not started again)
                    raise DeviceLostError(f"device(s) {sorted(self.lost)} were lost and not started again")
                raise StallError("the controller waits for events but no device has work")
            refs = list(self.pending)
            timed = [r for r in refs if self.pending[r][0] != "join"]  # (a restart may take long)
            deadlines = {r: self.sent[r] + self.timeout for r in timed} if self.timeout else {}
            step = self.stepping
            if step is not None and step.lost:  # the rest of a step that lost a member get a short grace
                deadlines |= {r: step.lost_at + STEP_GRACE_S for r in step.refs}
            wait = max(0.0, min(deadlines.values()) - time.monotonic()) if deadlines else None
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait)
            if not ready:  # the call with the earliest deadline is past it: its device is lost
                late = min(deadlines, key=deadlines.__getitem__)
                instance = self.pending[late][1]
                if step is not None and late in step.refs:
                    device = step.refs[late]
                    if step.lost:
                        why = f"its part of the optimizer step was not done {STEP_GRACE_S:g} s after a member was lost"
                        stuck = [(device, why)]
                    else:  # the member holding the others, not the first whose deadline passed (all wait for it)
                        stuck = self._stuck_members(device, list(step.refs.values()))
                    # every member writes its stacks: which one is stuck, and which wait for it
                    blamed = [d for d, _ in stuck]
                    self._dump_stacks(blamed + [d for d in step.refs.values() if d not in blamed])
                else:
                    stuck = [(d, f"no answer within device_timeout={self.timeout:g} s")
                             for d in self.inst.members(instance)]  # fmt: skip
                    self._dump_stacks([d for d, _ in stuck])
                whys = {self.inst.of(d): why for d, why in reversed(stuck)}  # (an instance's, its first device's)
                for i in whys:
                    self._kill(i)
                self.lost.update(whys)  # (none of them is told to abandon the step)
                for i, why in whys.items():
                    out += self._lose(i, why)
                continue
            more, _ = ray.wait([r for r in refs if r not in ready], num_returns=len(refs) - 1, timeout=0)
            for ref in [*ready, *more]:
                if ref not in self.pending:  # dropped: its device was lost in this same batch
                    continue
                kind, device = self.pending.pop(ref)  # (the instance)
                self.sent.pop(ref, None)
                try:
                    result = ray.get(ref)  # re-raises a device's error here, with its traceback
                except Exception as e:
                    if isinstance(e, RayActorError) and not isinstance(e, RayTaskError):  # its process died
                        out += self._lose(device, f"its process died ({type(e).__name__})")
                        continue
                    # a step call broken by a member lost: a collective with a dead peer, or the rendezvous a
                    # dead rank 0 was to give (the call never ran); anything else is a real error
                    if kind != "step" or self.stepping is None:
                        raise
                    self.stepping.errors.append(e)
                    self.stepping.refs.pop(ref, None)
                    out += self._step_done()
                    continue
                if kind in ("event", "ack", "step", "gather"):  # (a command: what the device generated before it)
                    before, result = result
                    out += before
                if kind == "gather":
                    gather = self.gathers.pop(ref)
                    gather.results.append((gather.refs.pop(ref), result))
                    if not gather.refs:
                        out.append(gather.combine([e for _, e in sorted(gather.results, key=lambda r: r[0])]))
                elif kind == "step":
                    assert self.stepping is not None
                    self.stepping.refs.pop(ref, None)
                    if result is not None:  # (rank 0's, named by the step's instances)
                        self.stepping.trained = replace(result, devices=self.stepping.devices)
                    out += self._step_done()
                elif kind == "run":
                    events, has_work = result
                    self.running.discard(device)
                    out += events
                    if has_work or device in self.dirty:
                        self._run(device)
                elif kind == "join":
                    d = self.joining.pop(ref)
                    ray.get(self.actors[d].set_origin.remote(self.origin))
                    self.pids[d] = ray.get(self.actors[d].pid.remote())
                    if not any(i == device for k, i in self.pending.values() if k == "join"):  # its last device
                        self.lost.discard(device)
                        logger.warning("device %d is back", device)
                        out.append(DeviceJoined(device))
                elif kind == "event" and result is not None:
                    out.append(result)
        return out

    def _stuck_members(self, late: int, members: list[int]) -> list[tuple[int, str]]:
        """The members of an overdue optimizer step that hold it up, each with why, from how far each says it
        is (asked in its probe group, beside the step call: ``blame``)."""
        import ray

        asked = {self.actors[d].progress.options(concurrency_group=PROBE).remote(): d for d in members}
        done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=PROBE_S)
        progress: dict[int, int | None] = dict.fromkeys(members)
        for ref in done:
            try:
                progress[asked[ref]] = ray.get(ref)
            except Exception:  # (its process died meanwhile: as good as no answer)
                pass
        for d in members:
            logger.warning("optimizer step overdue: device %d %s", d, told(progress[d]))
        return blame(late, progress, self.timeout)

    def _dump_stacks(self, devices: list[int]) -> None:
        """Have devices (the first missed its deadline) write their threads' stacks to their logs (same machine
        only)."""
        here = dev.node_address()
        dumped = []
        for d in devices:
            if self.bindings[d].node_ip != here:
                continue
            try:
                os.kill(self.pids[d], signal.SIGUSR1)
                dumped.append(d)
            except (OSError, IndexError):
                pass
        if dumped:
            time.sleep(0.5)  # (each dump is written by the device's process, asynchronously)
            logger.warning("device(s) %s: their threads' stacks are in their logs above", ", ".join(map(str, dumped)))

    def _lose(self, device: int, reason: str) -> list[Event]:
        """Forget everything sent to instance ``device``; start it again (``restart_lost``); the events for the
        controller (held back while an optimizer step it was part of is still to resolve: see ``_step_done``).
        An instance is lost whole: its other devices are killed with it."""
        logger.warning("device %d lost: %s", device, reason)
        members = self.inst.members(device)
        if len(members) > 1:
            self._kill(device)
        for ref, (_, d) in list(self.pending.items()):
            if d == device:
                del self.pending[ref]
                self.sent.pop(ref, None)
                self.gathers.pop(ref, None)
                self.joining.pop(ref, None)
        self.running.discard(device)
        self.dirty.discard(device)
        self.lost.add(device)
        if set(members) & set(self.groups.devices):  # its group is broken: the next step meets anew
            self.groups.devices = ()
        step = self.stepping
        if step is not None and set(members) & set(step.refs.values()):
            # the others stop waiting for it to arrive (a member already in a collective with it fails there)
            for d in {d for d in step.refs.values() if self.inst.of(d) not in self.lost}:
                self.actors[d].abandon.options(concurrency_group=PROBE).remote(step.attempt)
            if not self.sharded:
                step.refs = {r: d for r, d in step.refs.items() if d not in members}
                step.lost.append(DeviceLost(device, reason))
                step.lost_at = step.lost_at or time.monotonic()
                return self._step_done()  # (it starts again once the step is resolved)
        self._restart(device)
        return [DeviceLost(device, reason)]

    def _kill(self, instance: int) -> None:
        import ray

        for d in self.inst.members(instance):
            ray.kill(self.actors[d], no_restart=True)

    def _restart(self, instance: int) -> None:
        if self.restart:
            for d in self.inst.members(instance):
                self.actors[d] = self._start(d)
                ref = self.actors[d].binding.remote()
                self._send(ref, "join", instance)
                self.joining[ref] = d

    def _step_done(self) -> list[Event]:
        """Once every call of the optimizer step in flight has returned: its outcome. Done (rank 0 reported
        it): ``Trained``, then the devices lost on the way. Not done: the lost devices, then ``StepFailed``
        for the others, with any version the step half-published taken out of the GPS again."""
        step = self.stepping
        if step is None or step.refs:
            return []
        self.stepping = None
        for e in step.lost:
            self._restart(e.device)
        if step.trained is not None:
            return [step.trained, *step.lost]
        if not step.lost:  # every call returned and none lost, yet no Trained: a real error
            raise step.errors[0] if step.errors else RuntimeError(f"the step of v{step.version} reported nothing")
        from pivotrl.gps import Kind

        assert self.store is not None
        if step.version + 1 in self.store.versions(POLICY, Kind.WEIGHTS):
            self.store.free(POLICY, step.version + 1, Kind.WEIGHTS)
        lost = {e.device for e in step.lost}
        survivors = tuple(d for d in step.devices if d not in lost)
        reason = "; ".join(f"device {e.device}: {e.reason}" for e in step.lost)
        logger.warning("the optimizer step of v%d failed (%s): it is done again", step.version, reason)
        return [*step.lost, StepFailed(survivors, step.version, reason)]

    def slices(self) -> list[Slice]:
        import ray

        out: list[Slice] = []
        for d, a in enumerate(self.actors):
            try:
                out += ray.get(a.drain_slices.remote(), timeout=30)
            except Exception as e:  # a device lost for good: its slices went with it
                logger.warning("device %d: no slices (%s)", d, type(e).__name__)
        return out

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        # a device with a command in flight (a step waiting for a lost member, a call the run ended in) would
        # answer a close only after it: it is killed without one (a look in flight comes back within POLL_S)
        busy = {i for kind, i in self.pending.values() if kind != "run"}
        inst = getattr(self, "inst", Instances.uniform(1, max(1, len(self.actors))))
        try:
            ray.get([a.close.remote() for d, a in enumerate(self.actors) if inst.of(d) not in busy | self.lost],
                    timeout=30)  # fmt: skip
        except Exception as e:  # a device that cannot leave its group cleanly is killed below anyway
            logger.warning("ray driver: closing the device actors: %s", e)
        for a in self.actors:
            ray.kill(a)
        if self.store is not None:
            self.store.shutdown()
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()
            if self.session_dir is not None:  # (only once it is down: a driver killed before leaves the marker)
                unmark_session(self.session_dir)
