"""The Ray face of one device: a ``Worker`` in a process of its own, and the engine processes beside it.

A device actor holds one bundle of the job's placement group (a GPU share when
devices are cuda; see ``pivotrl.runtime.devices``). Its Worker generates in a
thread of its own, slice after slice, while it holds sequences
(``pivotrl.runtime.stream``); the driver's calls leave their commands in that
thread's mailbox. Each vLLM engine runs in a process of its own beside the
device (``pivotrl.runtime.engine_host``); the first device of an instance of
several starts its engines' ranks in every bundle of the instance and drives
them (``pivotrl.runtime.instances``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time
from dataclasses import replace
from typing import Any

from pivotrl.control.messages import Accumulate, Event, Generate, Judge, Step
from pivotrl.gps import RayStore
from pivotrl.runtime import devices as dev
from pivotrl.runtime.contexts import JUDGE, POLICY, ContextSpec
from pivotrl.runtime.engine_host import EngineClient, EngineHost, needs_process, ray_client, ray_instance_client
from pivotrl.runtime.instances import Member
from pivotrl.runtime.stream import Stream
from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.telemetry import Slice

SLICE_SECONDS = 0.05
PROBE = "probe"  # a device actor's concurrency group for questions answered while a call runs (its own thread)


class DeviceActor:
    """The Ray face of a Worker (methods run one at a time, in call order)."""

    def __init__(
        self,
        device: int,
        store: RayStore,
        spec: ContextSpec,
        train: TrainSpec,
        origin: float,
        threads: int,
        bundle: int | None = None,
        gpu_share: float = 0.0,
        member: Member | None = None,
    ) -> None:
        """``device``: its index among the job's devices (and its placement-group bundle's); ``member``: its place
        in its instance (None: an instance of its own), given again by ``configure`` once the plan is known."""
        self.member = member or Member(device, 0, (device,))
        # its models' engines that run in processes of their own (engine_host), once their backends are known: now
        # for a device restarted with the run's plan, else when the plan comes (configure)
        self.clients: dict[str, EngineClient] = {}
        self._engines = (store, spec, threads, bundle, gpu_share)
        self._start_engines(spec)
        spec = replace(spec, device=dev.bind(spec.device))  # see the devices module for a GPU torch cannot see
        self.bundle = bundle  # the placement-group bundle it was scheduled into (Ray does not tell an actor)
        self.worker = Worker(
            self.member.instance, store, spec, train, origin, threads=threads, engines=self.clients.__getitem__,
            gpu=device, serves=self.member.rank == 0,
        )  # fmt: skip
        self.stream = Stream(self.worker, SLICE_SECONDS)  # (it generates on its own while it holds sequences)
        # a device about to be declared lost for missing its deadline is first asked for its threads' stacks
        # (written to its log, which Ray forwards to the driver's): what it was stuck in
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def pid(self) -> int:
        return os.getpid()

    def binding(self) -> dev.Binding:
        """What this actor holds, as it sees it."""
        import ray
        import torch

        ctx = ray.get_runtime_context()
        return dev.Binding(
            device=self.worker.device,
            bundle=self.bundle,
            placement_group=ctx.get_placement_group_id(),
            node_ip=dev.node_address(),
            gpu_ids=tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", [])),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            kind=dev.CUDA if self.worker.spec.device == dev.CUDA else dev.CPU,
            threads=torch.get_num_threads(),
            memory_bytes=dev.gpu_memory() if self.worker.spec.device == dev.CUDA else 0,
            bf16=dev.bf16_supported() if self.worker.spec.device == dev.CUDA else True,
        )

    def configure(self, plan: Any, member: Member | None = None) -> None:
        """The run's plan, and this device's place in its instance (None: an instance of its own)."""
        self.member = member or self.member

        def take() -> None:
            self.worker.configure(plan)
            self.worker.device, self.worker.serves = self.member.instance, self.member.rank == 0

        self.stream.hold(take)
        self._start_engines(replace(self._engines[1], **plan.serving()))

    def _start_engines(self, spec: ContextSpec) -> None:
        """Start the engine process of each model whose backend needs one (in the background: the start of a
        process and its imports is paid beside the rest, not at the first shift). The first device of an
        instance of several starts an engine process in each of its instance's bundles, the ranks of one
        tensor-parallel engine, and drives them all; the others serve no engine."""
        store, _, threads, bundle, share = self._engines
        if self.member.rank:
            return
        for name in (POLICY, JUDGE):
            if needs_process(spec.backend(name)) and name not in self.clients:
                if len(self.member.bundles) == 1:
                    self.clients[name] = _engine_process(name, store, spec, threads, bundle, share)
                else:
                    self.clients[name] = _engine_ranks(name, store, spec, threads, self.member.bundles, share)

    # -- commands: each runs between two slices of generation and returns the events generated before it, then
    # its own result (pivotrl.runtime.stream) --
    def shift(self, role: Any, version: int) -> tuple[list[Event], Event]:
        return self.stream.call(lambda: self.worker.shift(role, version))

    def hang(self) -> None:
        """Stop answering (fault injection, ``fault.kind=hang``): the calls queued behind this one wait."""
        while True:
            time.sleep(3600)

    def hang_in_next_step(self) -> None:
        self.worker.hang_in_next_step()

    # -- called in the PROBE concurrency group (their own thread), beside the call in progress: what the
    # driver asks of the members of an overdue optimizer step --
    def progress(self) -> int:
        return self.worker.progress()

    def abandon(self, attempt: int) -> None:
        self.worker.abandon(attempt)

    def generate(self, cmd: Generate) -> tuple[list[Event], None]:
        return self.stream.call(lambda: self.worker.generate(cmd))

    def judge(self, cmd: Judge) -> tuple[list[Event], None]:
        return self.stream.call(lambda: self.worker.judge(cmd))

    def run(self, seconds: float) -> tuple[list[Event], bool]:
        """What the device generated since the last look (waiting up to ``seconds`` for the next slice's), and
        whether it still holds sequences."""
        return self.stream.poll(seconds)

    def abort(self, uids: tuple[int, ...] = ()) -> tuple[list[Event], Event]:
        return self.stream.call(lambda: self.worker.abort(uids))

    def accumulate(self, cmd: Accumulate) -> tuple[list[Event], Event]:
        return self.stream.call(lambda: self.worker.accumulate(cmd))

    def listen(self, world_size: int) -> tuple[str, int]:
        return self.stream.hold(lambda: self.worker.listen(world_size))

    def retire_group(self) -> None:
        self.stream.hold(self.worker.retire_group)

    def step(
        self, cmd: Step, rank: int, rendezvous: Any, state_world: int, attempt: int, *after: object
    ) -> tuple[list[Event], Event | None]:
        return self.stream.call(lambda: self.worker.step(cmd, rank, rendezvous, state_world, attempt))

    def close(self) -> None:
        self.stream.hold(self.worker.close)

    def drain_slices(self) -> list[Slice]:
        return self.stream.hold(self.worker.drain_slices)

    def set_origin(self, origin: float) -> None:
        self.worker.origin = origin


def _engine_process(
    name: str, store: RayStore, spec: ContextSpec, threads: int, bundle: int | None, gpu_share: float
) -> EngineClient:
    """Start model ``name``'s engine process in the caller's placement-group bundle (the device's), with its
    share of the device's GPU; owned by the caller, it dies with it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    where = PlacementGroupSchedulingStrategy(pg, bundle) if pg is not None and bundle is not None else None
    remote = ray.remote(EngineHost).options(num_cpus=0, num_gpus=gpu_share, scheduling_strategy=where)
    return ray_client(remote.remote(name, store, spec, threads), name)


def _engine_ranks(
    name: str, store: RayStore, spec: ContextSpec, threads: int, bundles: tuple[int, ...], gpu_share: float
) -> EngineClient:
    """Model ``name``'s tensor-parallel engine over an instance: one process per bundle of ``bundles`` (rank r
    in the r-th, the caller's first), meeting at a port of the caller's node (an instance is on one node);
    owned by the caller, they die with it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    with socket.socket() as s:  # (a port free now, taken by rank 0's store when the engine builds)
        s.bind((dev.node_address(), 0))
        port = s.getsockname()[1]
    meet = (dev.node_address(), port)
    hosts = []
    for rank, b in enumerate(bundles):
        where = PlacementGroupSchedulingStrategy(pg, b) if pg is not None else None
        remote = ray.remote(EngineHost).options(num_cpus=0, num_gpus=gpu_share, scheduling_strategy=where)
        hosts.append(remote.remote(name, store, spec, threads, rank, meet))
    return ray_instance_client(hosts, name)
