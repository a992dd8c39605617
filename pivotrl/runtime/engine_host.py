"""Engines in processes of their own: on each GPU, one process per model it serves.

vLLM 0.32 allocates an engine's weights and KV cache through one sleep-mode
allocator per process (``CuMemAllocator``, on whenever sleep mode is), and its
GPU worker refuses to load a second engine's weights in a process whose
allocator already holds memory (``gpu_worker.py``: "CuMem allocator can only
be used for one instance per process"); ``sleep`` unmaps every awake
allocation of the process, whichever engine made it. So a device that serves
both the policy and the judge on vLLM keeps each engine in a process of its
own, beside the device's process (which holds the trainer):

    device d (one GPU, or a share of one)
    ├── device process     the Worker: requests, tokenizers, the trainer
    ├── policy engine      EngineHost("policy")  - asleep unless d is in rollout
    └── judge engine       EngineHost("judge")   - asleep unless d is in judge

A shift to a generation role wakes that model's process (its engine built
there on the first visit, never again) and loads the version from the GPS;
leaving the role puts the engine to sleep. The control plane still sees one
device. Backends differ in what they need (``needs_process``): vLLM always
gets its process (the same rule on a CPU, where vLLM has no sleep mode, so
the CPU runs what a GPU runs); the native engine stays in the device's
process, where torch's own allocator serves every model at once.

The device's process talks to its engine through :class:`EngineClient`, the
generation protocol over calls: adds are sent without waiting (an actor runs
one caller's calls in order), everything else waits for its answer. On Ray
the engine process is an actor in the device's placement-group bundle, with
an equal share of its GPU (``devices.process_share``); it dies with the device
actor that owns it, so a lost device loses its engines too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from pivotrl.engine.engine import EngineStats, SeqState
from pivotrl.engine.protocol import SliceReport
from pivotrl.gps import ParameterStore
from pivotrl.runtime.contexts import ContextSpec, GenerationContext, Tokenizer, tokenizer_of

MAX_SLICE_STEPS = 256  # engine steps a slice of a tensor-parallel engine may run (its estimate of a step's time off)
OWN_PROCESS = ("vllm",)  # backends whose engine runs in a process of its own (see the module docstring)
ENGINE_DIED = 70  # the exit status of a device's process whose engine's process died


def needs_process(backend: str) -> bool:
    """Whether an engine of ``backend`` runs in a process of its own."""
    return backend in OWN_PROCESS


def engine_processes(rollout_backend: str, judge_backend: str, kind: str) -> int:
    """The processes a device may run, counted before the plan resolves ``auto``: its own, and one per model whose
    engine may need one (engine_host). An auto that resolves to the native engine leaves its share unused."""
    from pivotrl.engine.vllm_engine import available

    def maybe(asked: str) -> bool:
        return needs_process(asked) or (asked == "auto" and kind == "cuda" and available())

    return 1 + maybe(rollout_backend) + maybe(judge_backend)


@dataclass(slots=True, frozen=True)
class Opened:
    """What an engine's process answers when its engine wakes with a version."""

    nbytes: int  # bytes loaded from the GPS
    meta: dict[str, Any] | None  # the checkpoint's meta (the tokenizer's source): with the first open only
    max_batch: int
    max_len: int
    builds: tuple[str, ...]  # the models whose engines this process has built
    pid: int


class EngineHost:
    """One model's generation engine, in the process that runs this object (a Ray actor, or a test's).

    ``open`` builds the engine on the first visit and wakes it on every later
    one, loading the version from the GPS; ``release`` puts it to sleep. What
    it built is reported with each open (``builds``): the guard that no
    process ever holds engines of two models reads it from the run's events.
    """

    def __init__(
        self, name: str, store: ParameterStore, spec: ContextSpec, threads: int = 1, rank: int = 0,
        meet: tuple[str, int] = ("", 0),
    ) -> None:  # fmt: skip
        """``rank`` of the instance's ``spec.tensor_parallel`` ranks, meeting the others at ``meet`` (address,
        port): set in the environment before vLLM reads it (a world of one needs none)."""
        import torch

        from pivotrl.runtime import devices as dev

        if spec.tensor_parallel > 1 and spec.backend(name) == "vllm":
            from pivotrl.engine.vllm_engine import rank_environment

            os.environ.update(rank_environment(rank, spec.tensor_parallel, *meet, cuda=spec.device == "cuda"))
        torch.set_num_threads(threads)
        if spec.backend(name) == "vllm":  # its imports at the start, beside the other processes, not at a shift
            from pivotrl.engine.vllm_engine import import_vllm

            import_vllm()
        self.spec = replace(spec, device=dev.bind(spec.device))  # (the device's GPU: the bundle's, shared)
        self.name, self.store = name, store
        self.ctx: GenerationContext | None = None  # while awake
        self.kept: Any = None  # the engine, asleep
        self.builds: list[str] = []  # models whose engine this process built

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def pid() -> int:
        return os.getpid()

    def open(self, version: int) -> Opened:
        """Wake (or build, on the first visit) the engine and load ``version`` from the GPS."""
        if self.ctx is not None:
            raise RuntimeError(f"{self.name} engine: opened while awake")
        first = self.kept is None
        self.ctx = GenerationContext(self.name, version, self.store, self.spec, self.kept)
        self.kept = None
        if first:
            self.builds.append(self.name)
        engine = self.ctx.engine
        meta = self.ctx.meta if first else None
        return Opened(self.ctx.nbytes, meta, engine.max_batch, engine.max_len, tuple(self.builds), os.getpid())

    def refresh(self, version: int) -> int:
        return self._ctx().refresh(self.store, version)

    def release(self) -> None:
        """Put the engine to sleep (its device memory freed), kept for the next ``open``."""
        if self.ctx is not None:
            self.kept = self.ctx.release()
            self.ctx = None

    def add(self, states: list[SeqState]) -> None:
        engine = self._ctx().engine
        for s in states:
            engine.add(s)

    def abort(self, uids: list[int]) -> list[SeqState]:
        engine = self._ctx().engine
        return [engine.abort(u) for u in uids]

    def abort_all(self) -> list[SeqState]:
        return self._ctx().engine.abort_all()

    def run(self, seconds: float, steps: int = 0) -> tuple[SliceReport, EngineStats]:
        engine = self._ctx().engine
        report = engine.run(seconds, self.now, steps) if steps else engine.run(seconds, self.now)
        return report, engine.stats

    def ensure_capacity(self, max_len: int) -> None:
        self._ctx().engine.ensure_capacity(max_len)

    def close(self) -> None:
        engine = self.ctx.engine if self.ctx is not None else self.kept
        self.ctx = self.kept = None
        if engine is not None and hasattr(engine, "close"):
            engine.close()

    def _ctx(self) -> Any:
        if self.ctx is None:
            raise RuntimeError(f"{self.name} engine: asleep (no role on its device)")
        return self.ctx


Call = Callable[..., Any]  # (method name, *args) -> result; ``Send`` the same without waiting for it


class EngineClient:
    """The generation protocol for an engine in another process (:class:`EngineHost`), over ``call``.

    ``send`` issues a call whose answer is not waited for (adds); ``call``
    waits, and is issued after every earlier send (one caller's calls run in
    order), so an error of a send surfaces at the next call at the latest.
    The client mirrors which sequences the engine holds, so ``has_work`` and
    ``load`` need no call.
    """

    def __init__(self, name: str, call: Call, send: Call, ranks: int = 1) -> None:
        self.name, self._call, self._send = name, call, send
        # ranks of the engine (tensor parallel), every one given each call: a slice is a count of steps this side
        # decides (``run``), never each rank's own clock
        self.ranks = ranks
        self.step_s = 0.0  # seconds an engine step took, as the last slices measured it (ranks > 1)
        self.uids: set[int] = set()
        self.stats = EngineStats()  # the engine's, as its last run reported them
        self.max_batch = self.max_len = 0
        self.tokenizer: Tokenizer | None = None  # made from the first open's meta, kept

    def open(self, version: int) -> Opened:
        """Wake the engine with ``version`` (built there on the first open)."""
        opened: Opened = self._call("open", version)
        self.max_batch, self.max_len = opened.max_batch, opened.max_len
        if opened.meta is not None:
            self.tokenizer = tokenizer_of(opened.meta)
        return opened

    def refresh(self, version: int) -> int:
        """Load ``version`` in place; the bytes a rank copied (every rank its shard, of one size)."""
        return self._call("refresh", version)

    def release(self) -> None:
        self._call("release")
        self.uids.clear()

    def add(self, state: SeqState) -> None:
        if state.uid in self.uids:
            raise ValueError(f"sequence {state.uid} is already in this engine")
        self._send("add", [state])
        self.uids.add(state.uid)

    def abort(self, uid: int) -> SeqState:
        if uid not in self.uids:
            raise KeyError(f"sequence {uid} is not in this engine")
        self.uids.discard(uid)
        (state,) = self._call("abort", [uid])
        return state

    def abort_all(self) -> list[SeqState]:
        states = self._call("abort_all")
        self.uids.clear()
        return states

    @property
    def has_work(self) -> bool:
        return bool(self.uids)

    @property
    def load(self) -> int:
        return len(self.uids)

    def run(self, seconds: float, clock: Callable[[], float]) -> SliceReport:
        if self.ranks == 1:
            report, self.stats = self._call("run", seconds)
        else:
            steps = max(1, min(MAX_SLICE_STEPS, round(seconds / self.step_s))) if self.step_s else 1
            t0, before = clock(), self.stats.steps
            report, self.stats = self._call("run", seconds, steps)
            ran = self.stats.steps - before
            if ran:
                took = (clock() - t0) / ran
                self.step_s = took if not self.step_s else 0.5 * (self.step_s + took)
        for s in report.finished:
            self.uids.discard(s.uid)
        return report

    def ensure_capacity(self, max_len: int) -> None:
        self._call("ensure_capacity", max_len)

    def load_weights(self, snap: Any) -> None:
        raise RuntimeError("an engine in its own process loads its weights from the GPS itself (refresh)")

    def sleep(self) -> None:
        self.release()

    def wake(self) -> None:
        raise RuntimeError("an engine in its own process wakes with a version (open)")

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self.uids.clear()


class RemoteGeneration:
    """A generation role whose engine runs in a process of its own: the device's side of it (the tokenizer,
    the version) with the engine behind an :class:`EngineClient`; the same face as
    :class:`~pivotrl.runtime.contexts.GenerationContext`."""

    def __init__(self, name: str, version: int, client: EngineClient) -> None:
        opened = client.open(version)
        assert client.tokenizer is not None, "the first open brings the tokenizer"
        # (the bytes loaded on every rank of a tensor-parallel engine: each its shard, ``rank_bytes``)
        self.rank_bytes = opened.nbytes
        self.name, self.version, self.nbytes = name, version, opened.nbytes * client.ranks
        self.engine, self.tokenizer = client, client.tokenizer
        self.builds, self.pid = opened.builds, opened.pid

    def refresh(self, store: ParameterStore, version: int) -> int:
        """Load another version of the same model in place (the engine must be idle); its process reads the
        GPS itself."""
        self.rank_bytes = self.engine.refresh(version)
        self.version = version
        return self.rank_bytes * self.engine.ranks

    def release(self) -> EngineClient:
        """Put the engine to sleep; the client is what comes back to it."""
        self.engine.release()
        return self.engine


def local_client(host: EngineHost) -> EngineClient:
    """A client of a host in this very process (tests, and a CPU without Ray: vLLM there has no sleep mode)."""

    def call(method: str, *args: Any) -> Any:
        return getattr(host, method)(*args)

    return EngineClient(host.name, call, call)


def ray_client(actor: Any, name: str) -> EngineClient:
    """A client of a host that is a Ray actor. Its calls wait without a bound of their own: they run inside a
    call of the device's, which the driver bounds (``device_timeout``); a device lost kills its engines."""
    import ray
    from ray.exceptions import RayActorError

    sent: list[Any] = []

    def flush() -> None:
        if sent:
            refs = list(sent)
            sent.clear()
            ray.get(refs)

    def send(method: str, *args: Any) -> None:
        sent.append(getattr(actor, method).remote(*args))

    def call(method: str, *args: Any) -> Any:
        ref = getattr(actor, method).remote(*args)
        try:
            flush()  # (the sends ran before this call: their errors, first)
            return ray.get(ref)
        except RayActorError as e:  # the engine's process died: the device is lost with it
            engine_died(name, e)

    return EngineClient(name, call, send)


def ray_instance_client(actors: list[Any], name: str) -> EngineClient:
    """A client of a tensor-parallel engine whose ranks are the host actors ``actors`` (rank 0 first): every
    call goes to every rank, in the same order (each rank runs its own scheduler, so they agree only on the same
    calls), and rank 0's answer is the engine's. A rank's error is the engine's; a rank's process that died ends
    the device's, as for one rank."""
    import ray
    from ray.exceptions import RayActorError

    sent: list[Any] = []

    def send(method: str, *args: Any) -> None:
        sent.extend(getattr(a, method).remote(*args) for a in actors)

    def call(method: str, *args: Any) -> Any:
        refs = [getattr(a, method).remote(*args) for a in actors]
        try:
            if sent:
                earlier = list(sent)
                sent.clear()
                ray.get(earlier)
            return ray.get(refs)[0]
        except RayActorError as e:
            engine_died(name, e)

    return EngineClient(name, call, send, ranks=len(actors))


def engine_died(name: str, error: BaseException) -> NoReturn:
    """End the device's process: its engine's process died (a crash, the memory killer, a fatal CUDA error),
    and the driver takes a device whose process is gone for lost, restarting it with new engines; an error
    raised instead would reach the driver as the device's own failure and end the run."""
    from pivotrl.log import logger

    logger.error("the %s engine's process died (%s): this device's process ends with it", name, type(error).__name__)
    os._exit(ENGINE_DIED)
