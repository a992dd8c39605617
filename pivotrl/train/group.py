"""A train group: one membership epoch of the train role, and the collectives its ranks run.

Membership. A :class:`TrainGroup` is one *membership epoch*: the ranks that
train while the set of train devices holds, over as many steps as it does
(the drivers keep it; see :mod:`pivotrl.runtime.groups`). When the set
changes the group is left and a new one joined (on a fresh port); a process
may do this any number of times (checked with gloo: destroy then re-init in
the same process). Every trainer (:mod:`pivotrl.train.registry`) steps over
one.

Joining. Rank 0 listens first (:func:`listen`), the others are told its port;
each rank counts itself in at the rendezvous and waits for the rest, giving up
when the driver says a member is lost (``abandon``) or when rank 0's end is
gone (:class:`RendezvousGone`).

:func:`gather_step_stats` is the one small collective of an optimizer step:
every rank's policy version (checked equal), its loss sums and which
parameters got a gradient.

This is the one module that names distributed backends (``backend_for``).
"""

from __future__ import annotations

import math
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pivotrl.log import logger

# device type -> torch.distributed backend; an unknown device type fails loudly
_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}

DEFAULT_TIMEOUT_S = 600.0  # how long a collective (or the rendezvous) waits for the slowest rank
MIN_COLLECTIVE_S = 60.0  # the least a collective is given, however short the device timeout
# NCCL's settings for a train group, where the user set none (read when the process group is made). Blocking
# wait: a rank's wait on a collective returns when it completes, and raises in the rank's own thread when it times
# out or its communicator is aborted (without it, torch's timeout is the watchdog's alone, and an aborted
# collective's host sync returns with partial sums). Error handling 2: the watchdog aborts the communicator and
# keeps the process (torch's default, 3, ends it without cleaning up).
NCCL_SETTINGS = (("TORCH_NCCL_BLOCKING_WAIT", "1"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"))
CONNECT_TIMEOUT_S = 15.0  # how long joining may take to reach a rank 0 that already listens
CONNECT_TRY_S = 2.0  # one try at it (a reset connection is looked at again, not retried blindly)
ARRIVAL_POLL_S = 0.05  # how often a rank waiting for the others to arrive looks whether to give up
ARRIVED = "pivotrl/arrived"  # the rendezvous store's count of the ranks that came
# torch 2.13 names the single-tensor collectives *_single; older releases (2.11 on some GPU images) only *_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Per-rank numbers gathered at every step. Sums merge by addition, extremes by max/min. A sum in _OPTIONAL is reported
# only where some rank has it (the KL term, the off-policy correction's weights).
_SUM_KEYS = (
    "tokens", "loss_sum", "pg_loss_sum", "clipped_tokens", "kl_sum", "mismatch_sum", "is_weight_sum",
    "is_capped_tokens",
)  # fmt: skip
_OPTIONAL = {"kl_sum": "kl_sum", "is_weight_sum": "is_weight_sum", "is_capped_tokens": "is_weight_sum"}
_MAX_KEYS, _MIN_KEYS = ("ratio_max", "is_weight_max"), ("ratio_min",)
# Columns of the gathered row: version, a has-it flag per optional sum, the sums, the maxima, the minima, one
# has-grad flag per parameter.
_VERSION, _HAS, _SUMS = 0, 1, 1 + len(_OPTIONAL)
_MAXES = _SUMS + len(_SUM_KEYS)
_MINS = _MAXES + len(_MAX_KEYS)
_FLAGS = _MINS + len(_MIN_KEYS)


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device``: NCCL between GPUs, gloo between CPU processes."""
    device = torch.device(device)
    try:
        return _BACKENDS[device.type]
    except KeyError:
        raise ValueError(
            f"no distributed backend for device type {device.type!r}; supported: {', '.join(_BACKENDS)}"
        ) from None


def collective_timeout(device_timeout: float) -> float:
    """How long a train group's rendezvous and each collective wait: well under the driver's bound on a device's
    call (``device_timeout``), so that a rank left waiting for a peer that will not come fails by itself (its
    step reported failed, the device kept) before the driver takes it for lost too. NCCL gives a survivor no
    error when a peer dies: it waits in the collective until this timeout."""
    return max(MIN_COLLECTIVE_S, device_timeout / 3)


def listen(world_size: int, master_addr: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's end of a train group's rendezvous, bound now to a port the system picks (``.port``):
    the other ranks are told the port once it is taken. Hand it to :meth:`TrainGroup.join`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (one rank needs no rendezvous), got {world_size!r}")
    return dist.TCPStore(master_addr, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)  # fmt: skip


def _group_count() -> int | None:
    """How many process groups this process has named (torch keeps the count; None where it does not)."""
    return getattr(dist.distributed_c10d._world, "group_count", None)


def _undo_failed_join(count: int | None) -> None:
    """Put this process back as it was before a join that failed midway (a peer lost during the rendezvous).
    Every rank names its process group by a count of the groups its process made, and the group's keys in the
    rendezvous store carry that name; torch resets the count only when a group is destroyed. Left one ahead, this
    rank would write its keys of the next group under another name than its new peers, and all would wait for
    ever."""
    if dist.is_initialized():  # a failure after the group was made (its barrier): leave it
        dist.destroy_process_group()
    if count is not None:
        dist.distributed_c10d._world.group_count = count


class RendezvousGone(RuntimeError):
    """Rank 0 of a train group listened, and its end is closed now: its process is gone."""


class JoinAbandoned(RuntimeError):
    """A rank gave up waiting for the others of its train group: one of them is lost (the driver said so)."""


def _arrive(store: dist.Store, rank: int, world_size: int, timeout: timedelta, abandon: Callable[[], bool]) -> None:
    """Count this rank in at the rendezvous and wait until every rank has come, looking every
    ``ARRIVAL_POLL_S`` whether to give up (``abandon``): torch's own wait for the others cannot be
    interrupted, and a peer that died before it came would hold this rank there for the whole timeout."""
    deadline = time.monotonic() + timeout.total_seconds()
    came = store.add(ARRIVED, 1)
    while came < world_size:
        if abandon():
            raise JoinAbandoned(f"rank {rank}: gave up waiting for {world_size - came} of {world_size} ranks")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: timed out after {timeout} waiting for {world_size - came} of "
                               f"{world_size} ranks")  # fmt: skip
        time.sleep(ARRIVAL_POLL_S)
        came = store.add(ARRIVED, 0)


def _connect(master_addr: str, master_port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A client of rank 0's store, which already listens. A refused connection means rank 0 is gone (its process
    died between telling its port and the others arriving): fail at once. Short tries, each after a look at the
    port, because a torch store's client retries a reset or refused connection until its whole timeout."""
    where = f"{master_addr}:{master_port}"
    deadline = time.monotonic() + min(timeout.total_seconds(), CONNECT_TIMEOUT_S)
    while True:
        try:
            socket.create_connection((master_addr, master_port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise RendezvousGone(f"rank 0 of the train group listened at {where} and is gone ({e})") from None
        try:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                                  timeout=timedelta(seconds=CONNECT_TRY_S))  # fmt: skip
        except dist.DistNetworkError as e:  # reset mid-handshake (it died just now), or slow: look again
            if time.monotonic() > deadline:
                raise RendezvousGone(f"rank 0 of the train group at {where} did not answer ({e})") from None
            continue
        store.set_timeout(timeout)  # the rest of the rendezvous and every collective wait as long as asked
        return store


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` names the current GPU (a device actor sees one, as 0).
    ``torch.cuda.set_device`` and NCCL's ``device_id`` refuse a CUDA device without one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class TrainGroup:
    """One membership epoch of the train role: this process's rank in a torch.distributed process group.

    World size 1 creates no process group and makes no ``torch.distributed``
    call at all: a single train device needs no rendezvous, and this is the
    common case on one machine. The process group is the default one, so a
    process is in at most one train group at a time; :meth:`leave` before
    joining the next. Joining takes tens of milliseconds on loopback with
    gloo. Re-using the previous epoch's port works (checked: four epochs on
    one port), but a fresh port per epoch guarantees that a rank still
    finishing the old epoch can never rendezvous with the new one.
    """

    __slots__ = ("_joined", "aborted", "address", "backend", "device", "marks", "rank", "staged", "world_size")

    def __init__(
        self, rank: int, world_size: int, device: torch.device, backend: str, address: str | None, staged: bool = False
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.address = address
        # collectives go through host memory over gloo: ranks that share a GPU (``gpus_per_device`` below 1),
        # where NCCL refuses a second rank on the same device
        self.staged = staged
        self._joined = False  # a process group is made (join sets it) for several ranks, or one if asked
        self.aborted = False  # its communicator was aborted (``abort``): a member lost
        # how far this rank got: one more before each collective it enters. Ranks waiting in a collective have
        # counted it; one stuck before it (a hung kernel, a stuck call) has not: it is the one holding the others
        self.marks = 0

    def mark(self) -> None:
        """Count one more point of progress (before a collective, or a pass that contains some)."""
        self.marks += 1

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        *,
        device: torch.device | str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        store: dist.TCPStore | None = None,
        process_group: bool = False,
        listening: bool = False,
        abandon: Callable[[], bool] | None = None,
        staged: bool = False,
    ) -> TrainGroup:
        """Rendezvous with the other ``world_size - 1`` ranks at ``master_addr:master_port`` (rank 0 listens there).

        Rank 0 may bring the end it opened with :func:`listen` (``store``; its
        port is the one the others were told): a port chosen free and bound only
        here could be taken in between by any other socket of the machine.
        Blocks until every rank has arrived or ``timeout_s`` passes; the same
        timeout later bounds each collective, i.e. how long the fastest rank
        waits for the slowest at :meth:`ElasticTrainer.step`.

        ``listening``: rank 0 already holds its end (it called :func:`listen`
        before the others were told the port). A refused connection then means
        rank 0 is gone, and joining fails at once with :class:`RendezvousGone`
        instead of retrying for ``timeout_s`` (a torch store's client retries a
        refused connection until its timeout).

        ``abandon``: looked at while this rank waits for the others to arrive;
        once it says so, joining fails with :class:`JoinAbandoned` (a peer is
        lost and will not come).

        ``staged``: the ranks may share a GPU (``gpus_per_device`` below 1). NCCL takes one rank per GPU, so
        the group is gloo's and every collective copies its tensors to host memory and back
        (:meth:`all_reduce_`, :meth:`all_gather`, :meth:`reduce_scatter_`, :meth:`all_gather_into_`): slower,
        for trying the whole path on one card, not for training at scale.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        device = indexed(torch.device(device))
        backend = "gloo" if staged else backend_for(device)
        if store is not None and rank != 0:
            raise ValueError(f"store: only rank 0 brings the end it listens on, got one for rank {rank}")
        if world_size == 1 and not process_group:
            return cls(0, 1, device, backend, None, staged)
        if world_size > 1:
            if store is not None:
                master_port = store.port
            if not isinstance(master_port, int) or not 0 < master_port < 65536:
                raise ValueError(f"master_port must be an int in [1, 65535] when world_size > 1, got {master_port!r}")
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        if dist.is_initialized():
            raise RuntimeError("this process is already in a train group (or another process group); leave() it first")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":  # (read when the process group is made; a setting of the user's is kept)
            for key, value in NCCL_SETTINGS:
                os.environ.setdefault(key, value)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if not staged:
                kwargs["device_id"] = device  # bind the communicator to this GPU now, not at the first collective
        timeout = timedelta(seconds=timeout_s)
        if world_size == 1:  # a group of one meets nobody: an in-process store
            address, store = "local", dist.HashStore()
        else:
            address = f"tcp://{master_addr}:{master_port}"
            logger.info("train group: rank %d/%d waiting for the others at %s (%s)", rank, world_size, address, backend)
            if store is None and listening and rank != 0:  # rank 0 is there already, or gone for good
                store = _connect(master_addr, master_port, world_size, timeout)
            elif store is None:  # rank 0 listens now, the others connect (retrying until it does)
                store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                                      wait_for_workers=False)  # fmt: skip
        start = time.perf_counter()
        if world_size > 1:
            _arrive(store, rank, world_size, timeout, abandon or (lambda: False))
        count = _group_count()
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        except BaseException:
            _undo_failed_join(count)  # (a peer lost midway: the next join must start as this one did)
            raise
        logger.info("train group: rank %d/%d joined in %.2f s", rank, world_size, time.perf_counter() - start)
        group = cls(rank, world_size, device, backend, address, staged)
        group._joined = True
        return group

    @property
    def active(self) -> bool:
        """True until :meth:`leave`; a world-size-1 group is always active (there is nothing to leave)."""
        return self._joined or self.world_size == 1

    def leave(self) -> None:
        """Destroy the process group so this process can join the next membership epoch. Idempotent."""
        if self._joined:
            try:
                dist.destroy_process_group()
            except Exception as e:  # (a communicator aborted: torch's teardown of it may fail; it is gone either way)
                if not self.aborted:
                    raise
                logger.warning("train group: rank %d left an aborted group (%s)", self.rank, e)
            self._joined = False
            logger.info("train group: rank %d/%d left %s", self.rank, self.world_size, self.address)

    def leave_after(self, error: BaseException) -> None:
        """Leave at once after ``error`` (a collective failed: a member is lost), so that this rank's connections
        close and the members still waiting on it fail too. gloo's ring collectives wait on a rank's neighbours
        only: a member two away from the lost one waits for neighbours that gave up, until its timeout, unless
        they close their ends. The frames of the error's traceback hold the process group and its pending work,
        which would keep the connections open after the group is destroyed: they are cleared first."""
        traceback.clear_frames(error.__traceback__)
        self.leave()

    def check_intact(self) -> None:
        """Raise if the group's communicator was aborted: a collective it ran may have stopped part way, so nothing
        computed since may be published."""
        if self.aborted:
            raise RuntimeError(f"train group {self.address}: aborted (a member is lost); the step is void")

    def abort(self) -> None:
        """Abort the group's communicator from another thread, so that this rank's collective in progress fails now
        instead of at its timeout: a member is lost. NCCL only: a dead peer gives its survivors no error there,
        while gloo's fail as the peer's connections close, or as its neighbours' do (:meth:`leave_after`; a peer
        hung, not dead, is met by the timeout). gloo's own abort does not stop a collective in progress."""
        if self._joined and self.backend == "nccl" and not self.aborted:
            self.aborted = True
            logger.warning("train group: rank %d aborts %s (a member is lost)", self.rank, self.address)
            dist.distributed_c10d._abort_process_group()

    def __enter__(self) -> TrainGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def _check(self) -> None:
        if not self.active:
            raise RuntimeError(f"train group {self.address} (rank {self.rank}/{self.world_size}) was left")

    def _host(self, tensor: Tensor) -> Tensor:
        """Where a collective runs on ``tensor``: itself, or (staged) a copy in host memory."""
        return tensor.to("cpu", copy=True) if self.staged else tensor

    def all_reduce_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the group in place (a no-op for one rank)."""
        self._check()
        if self.world_size > 1:
            self.mark()
            work = self._host(tensor)
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
            if work is not tensor:
                tensor.copy_(work)
        return tensor

    def reduce_scatter_(self, out: Tensor, tensor: Tensor) -> Tensor:
        """``out`` = this rank's 1/W slice of ``tensor`` summed over the group (``tensor`` holds W slices of
        ``out``'s size, in rank order)."""
        if self.world_size == 1:
            self._check()
            return out.copy_(tensor[: out.numel()])
        return self._into(_reduce_scatter, out, tensor)

    def all_gather_into_(self, out: Tensor, tensor: Tensor) -> Tensor:
        """``out`` = every rank's ``tensor`` end to end, in rank order."""
        if self.world_size == 1:
            self._check()
            return out[: tensor.numel()].copy_(tensor)
        return self._into(_all_gather_single, out, tensor)

    def _into(self, collective: Callable[[Tensor, Tensor], Any], out: Tensor, tensor: Tensor) -> Tensor:
        """``collective(out, tensor)`` over the group; staged, on host copies, ``out`` filled from its copy."""
        self._check()
        self.mark()
        work = torch.empty(out.shape, dtype=out.dtype) if self.staged else out
        collective(work, self._host(tensor))
        if work is not out:
            out.copy_(work)
        return out

    def all_gather(self, tensor: Tensor) -> Tensor:
        """``tensor`` of every rank stacked in rank order, ``[world_size, *tensor.shape]``.

        Reducing the stack locally (rather than all-reducing) gives every rank
        the same numbers in the same order, and lets one collective carry
        sums, maxima and minima together.
        """
        self._check()
        if self.world_size == 1:
            return tensor[None].clone()
        work = self._host(tensor.contiguous())
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        self.mark()
        dist.all_gather(parts, work)
        return torch.stack(parts).to(tensor.device)


def gather_step_stats(
    group: TrainGroup, version: int, local: dict[str, float], flags: Sequence[bool]
) -> tuple[dict[str, float], list[bool]]:
    """One small collective at an optimizer step: every rank's policy version, running stat sums and ``flags``
    (which parameters got a gradient). Returns the group's sums and, per parameter, whether any rank has a
    gradient; raises (on every rank alike) when the ranks hold different versions."""
    row = torch.zeros(_FLAGS + len(flags), dtype=torch.float64)
    row[_VERSION] = version
    row[_HAS:_SUMS] = torch.tensor([float(present in local) for present in _OPTIONAL.values()], dtype=torch.float64)
    row[_SUMS:_MAXES] = torch.tensor([float(local.get(k, 0.0)) for k in _SUM_KEYS], dtype=torch.float64)
    row[_MAXES:_MINS] = torch.tensor([local.get(k, -math.inf) for k in _MAX_KEYS], dtype=torch.float64)
    row[_MINS:_FLAGS] = torch.tensor([local.get(k, math.inf) for k in _MIN_KEYS], dtype=torch.float64)
    row[_FLAGS:] = torch.tensor([float(f) for f in flags], dtype=torch.float64)
    rows = group.all_gather(row.to(group.device)).cpu()
    versions = [int(v) for v in rows[:, _VERSION].tolist()]
    if len(set(versions)) > 1:
        raise RuntimeError(
            f"train group {group.address}: ranks hold different policy versions {versions} (by rank); "
            "a device that newly takes the train role must import the current version's state first"
        )
    sums = dict(zip(_SUM_KEYS, rows[:, _SUMS:_MAXES].sum(0).tolist(), strict=True))
    for key, has in zip(_OPTIONAL, rows[:, _HAS:_SUMS].any(0).tolist(), strict=True):
        if not has:
            del sums[key]
    maxes = zip(_MAX_KEYS, rows[:, _MAXES:_MINS].amax(0).tolist(), strict=True)
    extremes = [*maxes, *zip(_MIN_KEYS, rows[:, _MINS:_FLAGS].amin(0).tolist(), strict=True)]
    sums |= {k: v for k, v in extremes if math.isfinite(v)}  # (no rank had a token: none reported)
    return sums, rows[:, _FLAGS:].amax(0).bool().tolist()
