"""Ray driver: one actor per device, each a ``Worker`` with its own torch.

The embedded default starts a local Ray instance (no dashboard, loopback
only); ``ray_address`` joins an existing cluster instead (``ray start --head``
then ``--ray-address auto``). Weights travel through the GPS in Ray's object
store. Generation is time-sliced: the driver keeps one ``run`` call in
flight per busy device and turns what each returns into events, so rewards
stream and shifts are picked up between slices.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

from pivotrl.config import JobConfig
from pivotrl.control.messages import Abort, Accumulate, Command, Event, Generate, Judge, Shift, Step
from pivotrl.errors import UserError
from pivotrl.gps import RayStore
from pivotrl.log import logger
from pivotrl.runtime.contexts import ContextSpec
from pivotrl.runtime.groups import TrainGroups
from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.telemetry import Slice

SLICE_SECONDS = 0.05


class DeviceActor:
    """The Ray face of a Worker (methods run one at a time, in call order)."""

    def __init__(self, device: int, store: RayStore, spec: ContextSpec, train: TrainSpec, origin: float) -> None:
        self.worker = Worker(device, store, spec, train, origin, threads=1)

    def shift(self, role: Any, version: int) -> Event:
        return self.worker.shift(role, version)

    def generate(self, cmd: Generate) -> None:
        self.worker.generate(cmd)

    def judge(self, cmd: Judge) -> None:
        self.worker.judge(cmd)

    def run(self, seconds: float) -> tuple[list[Event], bool]:
        events = self.worker.run(seconds)
        return events, self.worker.has_work

    def abort(self, uids: tuple[int, ...] = ()) -> Event:
        return self.worker.abort(uids)

    def accumulate(self, cmd: Accumulate) -> Event:
        return self.worker.accumulate(cmd)

    def listen(self, world_size: int) -> tuple[str, int]:
        return self.worker.listen(world_size)

    def retire_group(self) -> None:
        self.worker.retire_group()

    def step(self, cmd: Step, rank: int, rendezvous: Any, state_world: int, *after: object) -> Event | None:
        return self.worker.step(cmd, rank, rendezvous, state_world)

    def close(self) -> None:
        self.worker.close()

    def drain_slices(self) -> list[Slice]:
        return self.worker.drain_slices()

    def set_origin(self, origin: float) -> None:
        self.worker.origin = origin


def check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody answers at: ray.init retries such an address for minutes."""
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit():
        try:
            socket.create_connection((host.removeprefix("ray://"), int(port)), timeout=5).close()
        except OSError as e:
            raise UserError(f"--ray-address {address}: nothing answers there ({e.strerror or e})") from None


def _join_cluster(address: str, kwargs: dict[str, Any]) -> None:
    """Join an existing cluster. Clusters started with ``ray start`` use token auth by
    default; a client finds the token in ~/.ray/auth_token (or RAY_AUTH_TOKEN) but only
    uses it when RAY_AUTH_MODE=token, so set that when a token is there."""
    import ray

    has_token = "RAY_AUTH_TOKEN" in os.environ or (Path.home() / ".ray" / "auth_token").is_file()
    if "RAY_AUTH_MODE" not in os.environ and has_token:
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[-1][:300]
        raise UserError(
            f"--ray-address {address}: cannot join the Ray cluster ({reason}); start it with `ray start --head` "
            "and, if it uses token auth, make its token available (~/.ray/auth_token or RAY_AUTH_TOKEN)"
        ) from None


class RayDriver:
    def __init__(self, cfg: JobConfig, spec: ContextSpec, origin: float, address: str | None = None) -> None:
        import ray

        if address is not None:
            check_reachable(address)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False, "log_to_driver": True}
            if address is None:
                ray.init(num_cpus=max(2, cfg.devices), _node_ip_address="127.0.0.1", **kwargs)
            else:
                _join_cluster(address, kwargs)
        self.store = RayStore.create(f"pivotrl-gps-{uuid.uuid4().hex[:8]}")
        actor = ray.remote(DeviceActor).options(num_cpus=0)  # torch threads are set per worker; see Worker
        train = TrainSpec(cfg.train, cfg.rollout.temperature)
        self.actors = [actor.remote(d, self.store, spec, train, origin) for d in range(cfg.devices)]
        self.pending: dict[Any, tuple[str, int]] = {}  # ObjectRef -> (kind, device)
        self.running: set[int] = set()  # devices with a run() in flight
        self.dirty: set[int] = set()  # devices given work since their run() was sent
        self.groups = TrainGroups()
        logger.info("ray driver: %d device actors", cfg.devices)

    def start_clock(self, origin: float) -> None:
        """Wait until every device actor is up, then share the run clock's origin."""
        import ray

        ray.get([a.set_origin.remote(origin) for a in self.actors])

    def submit(self, cmd: Command) -> None:
        if isinstance(cmd, Shift):
            self.pending[self.actors[cmd.device].shift.remote(cmd.role, cmd.version)] = ("event", cmd.device)
        elif isinstance(cmd, Generate | Judge):
            actor = self.actors[cmd.device]
            call = actor.generate if isinstance(cmd, Generate) else actor.judge
            self.pending[call.remote(cmd)] = ("ack", cmd.device)
            self.dirty.add(cmd.device)
            self._run(cmd.device)
        elif isinstance(cmd, Accumulate):
            self.pending[self.actors[cmd.device].accumulate.remote(cmd)] = ("event", cmd.device)
        elif isinstance(cmd, Step):
            rendezvous, after = self.groups.plan(cmd.devices, self._retire, self._listen)
            for rank, d in enumerate(cmd.devices):
                ref = self.actors[d].step.remote(cmd, rank, rendezvous, self.groups.state_world, *after)
                self.pending[ref] = ("event", d)
            self.groups.stepped(cmd.devices)
        elif isinstance(cmd, Abort):
            self.pending[self.actors[cmd.device].abort.remote(cmd.uids)] = ("event", cmd.device)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _retire(self, device: int) -> Any:
        return self.actors[device].retire_group.remote()

    def _listen(self, device: int, world_size: int) -> Any:
        # rank 0 binds its port before anyone is told it (a port found free and bound later can be taken in
        # between); the others' step calls get it as an argument, Ray resolving it before they run
        return self.actors[device].listen.remote(world_size)

    def _run(self, device: int) -> None:
        if device not in self.running:
            self.running.add(device)
            self.dirty.discard(device)
            self.pending[self.actors[device].run.remote(SLICE_SECONDS)] = ("run", device)

    def next_events(self) -> list[Event]:
        import ray

        if not self.pending:
            raise RuntimeError("the controller waits for events but no device has work")
        ready, _ = ray.wait(list(self.pending), num_returns=1)
        more, _ = ray.wait([r for r in self.pending if r not in ready], num_returns=len(self.pending) - 1, timeout=0)
        out: list[Event] = []
        for ref in [*ready, *more]:
            kind, device = self.pending.pop(ref)
            result = ray.get(ref)  # re-raises a device's error here, with its traceback
            if kind == "run":
                events, has_work = result
                self.running.discard(device)
                out += events
                if has_work or device in self.dirty:
                    self._run(device)
            elif kind == "event" and result is not None:
                out.append(result)
        return out

    def slices(self) -> list[Slice]:
        import ray

        return [s for part in ray.get([a.drain_slices.remote() for a in self.actors]) for s in part]

    def close(self) -> None:
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception as e:  # a device that cannot leave its group cleanly is killed below anyway
            logger.warning("ray driver: closing the device actors: %s", e)
        for a in self.actors:
            ray.kill(a)
        self.store.shutdown()
        if self.started_ray:
            ray.shutdown()
