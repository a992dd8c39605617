"""How GPS bytes cross between host and GPU: page-locked staging buffers kept per process, and bucketed,
non-blocking copies.

:meth:`pivotrl.gps.Snapshot.load_into` uses this on CUDA, and a GPU process's publish packs into a staging
buffer of its own (:func:`publish_staging`). The bookkeeping (which ranges are registered, how a staging buffer
grows, how bytes are cut into buckets and cycled through the staging buffer) is plain Python and tested on a
CPU; the CUDA calls are injected into :class:`HostPins` and :class:`Staging`.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pivotrl.gps import ALIGN, BUCKET_BYTES, DTYPES, PAGE, Snapshot, TensorEntry, _aligned_empty, _flat_tensor
from pivotrl.log import logger

# ---------------------------------------------------------------------------------------------------------------------
# Page-locked host memory (only where CUDA is)


def page_interior(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """Offsets ``[lo, hi)`` of the whole pages inside ``[address, address + nbytes)``; ``(0, 0)`` if none.

    Only whole pages are registered: CUDA refuses to register a page twice,
    and the first or last page of a buffer in Ray's object store may hold a
    neighbouring object that another snapshot registers.
    """
    lo = -(-address // page) * page
    hi = (address + nbytes) // page * page
    return (lo - address, hi - address) if hi > lo else (0, 0)


def _clear_cuda_error() -> None:
    """Read off the CUDA runtime's 'last error' after a failed call we handled ourselves.

    Otherwise torch's next kernel-launch check (``cudaGetLastError``) would
    report it as the kernel's failure. torch exposes no ``cudaGetLastError``;
    the runtime library it loaded is found by path in ``/proc/self/maps``, so
    ctypes reaches the same instance (a second copy would keep its own error).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError as e:
        logger.debug("gps: could not clear the CUDA error state (%s)", e)


def _cuda_register(address: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    # cudaHostRegisterDefault; then cudaHostRegisterReadOnly (8), which read-only mappings need
    for flags in (0, 8):
        err = cudart.cudaHostRegister(address, nbytes, flags)
        if err == cudart.cudaError.success:
            return True
        logger.debug("gps: cudaHostRegister(flags=%d) of %d bytes: %s", flags, nbytes, cudart.cudaGetErrorString(err))
        _clear_cuda_error()
    return False


def _cuda_unregister(address: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(address)
    if err != cudart.cudaError.success:
        logger.debug("gps: cudaHostUnregister: %s", cudart.cudaGetErrorString(err))
        _clear_cuda_error()


class HostPins:
    """The host ranges this process has page-locked for CUDA, one registration per range.

    Why not allocate versions with ``torch.empty(..., pin_memory=True)``: torch's
    pinned-memory allocator rounds every block up to a power of two (a 2.1 GB
    version takes 4 GB) and keeps freed blocks cached, so a freed version would
    never give its memory back; and Ray's object store allocates its own
    memory. Registering the buffer we already have (``cudaHostRegister``)
    page-locks exactly its pages, wherever they live, and unregistering gives
    them back. Registration also faults every page in, so a registered buffer
    is prefaulted.

    A buffer is registered at its first load into a CUDA device, not at publish:
    a process that never loads into a GPU (a CPU device, the driver, a
    publisher) never creates a CUDA context for it. Each buffer object is
    registered once; two objects over the same memory (two fetches of one Ray
    object) share the registration, which is dropped when the last of them is
    garbage-collected, i.e. when the last snapshot or tensor view of it goes.
    ``register``/``unregister`` are injectable so that the bookkeeping is
    tested without a GPU.
    """

    def __init__(
        self,
        register: Callable[[int, int], bool] = _cuda_register,
        unregister: Callable[[int], None] = _cuda_unregister,
    ) -> None:
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[int, int]] = {}  # id(buffer) -> (address, nbytes) registered
        self._users: dict[tuple[int, int], int] = {}  # (address, nbytes) -> buffer objects using it
        self._failed = False  # warn once per process

    def pin(self, buffer: np.ndarray) -> tuple[int, int] | None:
        """Offsets ``[lo, hi)`` of ``buffer`` that are page-locked (registering them now if needed), or None."""
        lo, hi = page_interior(buffer.ctypes.data, buffer.nbytes)
        if hi <= lo:
            return None
        key = (buffer.ctypes.data + lo, hi - lo)
        with self._lock:
            if self._ranges.get(id(buffer)) == key:
                return lo, hi
            if key not in self._users:
                start = time.perf_counter()
                if not self._register(*key):
                    if not self._failed:
                        self._failed = True
                        logger.warning(
                            "gps: cannot page-lock a %d-byte version for CUDA; loads copy from pageable memory",
                            key[1],
                        )
                    return None
                logger.debug("gps: page-locked %d bytes in %.3f s", key[1], time.perf_counter() - start)
                self._users[key] = 0
            self._users[key] += 1
            self._ranges[id(buffer)] = key
        finalizer = weakref.finalize(buffer, self._release, id(buffer), key)
        finalizer.atexit = False  # at exit the process lets go of everything; CUDA may already be torn down
        return lo, hi

    def _release(self, buffer_id: int, key: tuple[int, int]) -> None:
        with self._lock:
            self._ranges.pop(buffer_id, None)
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key]
                self._unregister(key[0])

    def registered(self, buffer: np.ndarray) -> tuple[int, int] | None:
        """Offsets ``[lo, hi)`` of ``buffer`` already page-locked (by :meth:`pin` of any buffer object over the
        same memory), or None; registers nothing."""
        lo, hi = page_interior(buffer.ctypes.data, buffer.nbytes)
        with self._lock:
            return (lo, hi) if hi > lo and (buffer.ctypes.data + lo, hi - lo) in self._users else None

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._users)


PINS = HostPins()  # this process's registrations


# ---------------------------------------------------------------------------------------------------------------------
# Staging buffers: page-locked once per process, reused


def _host_buffer(nbytes: int) -> tuple[np.ndarray, bool | None]:
    """A page-aligned host buffer of ``nbytes``, and whether CUDA page-locked it: asked only where this process
    computes on a GPU (None elsewhere: a process that never used CUDA creates no context for it)."""
    buffer = _aligned_empty(nbytes, PAGE)
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return buffer, None
    return buffer, _cuda_register(buffer.ctypes.data, nbytes)


def _let_go(buffer: np.ndarray, pinned: bool) -> None:
    if pinned:
        _cuda_unregister(buffer.ctypes.data)


class Staging:
    """A host buffer this process keeps and reuses, page-locked for CUDA: what loads onto a GPU copy through, and
    what a GPU's publish lands in.

    Why kept: page-locking costs a pass of the kernel over every page, and unlocking another; a snapshot is
    dropped after its load, so registering the version itself paid both at every load. A staging buffer
    registered once is reused by every load and publish of the process. It grows when a larger request comes
    (the smaller one is let go first) and never shrinks: a process moves the same models over and over. One
    user at a time (:meth:`hold` takes its lock). ``allocate`` returns a page-aligned buffer and whether CUDA
    page-locked it (None: not asked, no GPU in the process); ``release`` lets it go: injectable, so that the
    bookkeeping is tested without CUDA.
    """

    def __init__(
        self,
        allocate: Callable[[int], tuple[np.ndarray, bool | None]] = _host_buffer,
        release: Callable[[np.ndarray, bool], None] = _let_go,
    ) -> None:
        self._allocate, self._release = allocate, release
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None
        self.pinned = False
        self.allocations = 0  # buffers allocated so far: one per growth
        self._warned = False

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[np.ndarray]:
        """The first ``nbytes`` of the buffer (grown to hold them, in whole pages), the caller's alone until
        the block ends."""
        with self._lock:
            if self._buffer is None or self._buffer.nbytes < nbytes:
                self._drop()
                self._buffer, pinned = self._allocate(-(-max(nbytes, 1) // PAGE) * PAGE)
                self.pinned = bool(pinned)
                self.allocations += 1
                if pinned is False and not self._warned:
                    self._warned = True
                    logger.warning("gps: cannot page-lock a %d-byte staging buffer; copies go through pageable "
                                   "memory", self._buffer.nbytes)  # fmt: skip
            yield self._buffer[:nbytes]

    def release(self) -> None:
        """Let the buffer go (the next :meth:`hold` allocates again)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._buffer is not None:
            self._release(self._buffer, self.pinned)
            self._buffer, self.pinned = None, False


STAGING = Staging()  # this process's loads onto a GPU: two buckets' worth
PUBLISH = Staging()  # this process's publishes into Ray's object store: the largest version it published


def publish_staging() -> Staging | None:
    """Where a publish of this process packs before Ray's object store copies the bytes: in a Ray actor (a
    device, whose trainer publishes every step) the process's kept buffer, page-locked where it computes on a
    GPU (a GPU's bytes then arrive by DMA; the pages were locked, and faulted in, once for every publish).
    None in the driver: it publishes the initial weights once and keeps no version-sized buffer (a fresh one,
    let go after the put)."""
    import ray

    return PUBLISH if ray.get_runtime_context().get_actor_id() is not None else None


# ---------------------------------------------------------------------------------------------------------------------
# Bucketed loading: host bytes to the device in a few large copies, dtype conversion on the device


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, end)`` of the buffer, all inside tensor ``entry``."""

    entry: TensorEntry
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One host-to-device copy: buffer bytes ``[start, end)``, the pieces it carries."""

    start: int
    end: int
    pieces: tuple[Piece, ...]


def plan_buckets(entries: Iterable[TensorEntry], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Contiguous byte ranges of at most ``bucket_bytes`` that cover ``entries`` in buffer order.

    Small tensors share a bucket (the padding between them rides along); a
    tensor larger than a bucket is cut at multiples of ALIGN, so every piece
    starts on an element boundary and on an ALIGN boundary of its bucket.
    """
    size = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    pieces = [
        Piece(e, a, min(a + size, e.offset + e.nbytes))
        for e in sorted(entries, key=lambda e: e.offset)
        for a in range(e.offset, e.offset + e.nbytes, size)
    ]
    buckets: list[Bucket] = []
    group: list[Piece] = []
    for p in pieces:
        if group and p.end - group[0].start > size:
            buckets.append(Bucket(group[0].start, group[-1].end, tuple(group)))
            group = []
        group.append(p)
    if group:
        buckets.append(Bucket(group[0].start, group[-1].end, tuple(group)))
    return buckets


def _copy_bytes(dst: Tensor, src: Tensor, start: int, end: int, pinned: tuple[int, int] | None) -> None:
    """``dst[:] = src[start:end]``, split at the page-locked range so that each copy is wholly pinned or not.

    Non-blocking on CUDA either way: from page-locked memory the copy is a DMA
    that returns at once; from pageable memory CUDA stages the bytes before it
    returns, so the source is never read after this call.
    """
    cuts = {start, end}
    if pinned is not None:
        cuts |= {min(max(c, start), end) for c in pinned}
    edges = sorted(cuts)
    for a, b in zip(edges, edges[1:], strict=False):
        dst[a - start : b - start].copy_(src[a:b], non_blocking=dst.is_cuda)


def _bytes_of(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.uint8)


class _Ring:
    """Two slots of a staging buffer that buckets take turns in: the host fills one slot while the device copies
    out of the other. A slot is refilled only once the copies that read it are done (a CUDA event recorded
    after them; on a CPU the copies are done when they return)."""

    def __init__(self, host: Tensor, slot: int, device: torch.device) -> None:
        self.host, self.slot, self.device = host, slot, device
        self.fences: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def fill(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """The bucket's bytes copied into the next free slot; the slot (as long as the bucket)."""
        k = self.turn % 2
        fence = self.fences[k]
        if fence is not None:
            fence.synchronize()
        dst = self.host[k * self.slot : k * self.slot + bucket.end - bucket.start]
        dst.copy_(flat[bucket.start : bucket.end])
        return dst

    def sent(self) -> None:
        """The copies out of the slot last filled are queued."""
        if self.device.type == "cuda":  # (after the copies on the stream they were queued on: the device's)
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
            self.fences[self.turn % 2] = fence
        self.turn += 1


@torch.no_grad()
def load_bucketed(
    snap: Snapshot, targets: dict[str, Tensor], bucket_bytes: int = BUCKET_BYTES, staging: Staging | None = None
) -> None:
    """Copy ``snap`` into ``targets`` (stored name -> tensor, each once) as :meth:`Snapshot.load_into` does on a
    GPU. Works on any device (tests run it on a CPU); only CUDA gains from it.

    On CUDA the bytes go through this process's page-locked staging buffer (``staging``, default
    :data:`STAGING`), a bucket at a time in two slots: the host copies bucket i+1 into one slot while the device
    copies bucket i out of the other, so the buffer stays two buckets small whatever the model's size and the
    host-to-device copies are DMAs. A version already page-locked in place (:meth:`Snapshot.pin` of a
    snapshot held) is read in place instead. On a CPU, without ``staging``, straight from the version.
    """
    contiguous = {n for n, t in targets.items() if t.is_contiguous()}
    for name in targets.keys() - contiguous:  # a strided target cannot take a slice of flat bytes
        targets[name].copy_(snap.tensors[name])
    entries = [e for e in snap.manifest.entries if e.name in contiguous]
    if not entries:
        return
    devices = sorted({str(targets[e.name].device) for e in entries})
    if len(devices) > 1:
        raise ValueError(f"a bucketed load needs every tensor on one device; the module's are on {devices}")
    device = targets[entries[0].name].device
    cuda = device.type == "cuda"
    in_place = PINS.registered(snap.buffer) if cuda else None
    if cuda and staging is None and in_place is None:
        staging = STAGING
    flat = _flat_tensor(snap.buffer)
    buckets = plan_buckets(entries, bucket_bytes)
    slot = -(-max(b.end - b.start for b in buckets) // PAGE) * PAGE
    with staging.hold(2 * slot) if staging is not None else contextlib.nullcontext(None) as host:
        ring = None if host is None else _Ring(torch.from_numpy(host), slot, device)
        pinned = in_place if ring is None else ((0, slot) if staging is not None and staging.pinned else None)
        device_staging: Tensor | None = None
        for bucket in buckets:
            src, base = (flat, 0) if ring is None else (ring.fill(flat, bucket), bucket.start)
            if all(targets[p.entry.name].dtype == DTYPES[p.entry.dtype] for p in bucket.pieces):
                for p in bucket.pieces:  # no cast: straight into the parameters' bytes
                    dst = _bytes_of(targets[p.entry.name])[p.start - p.entry.offset : p.end - p.entry.offset]
                    _copy_bytes(dst, src, p.start - base, p.end - base, pinned)
            else:
                if device_staging is None:
                    device_staging = torch.empty(max(b.end - b.start for b in buckets), dtype=torch.uint8,
                                                 device=device)  # fmt: skip
                _copy_bytes(device_staging[: bucket.end - bucket.start], src, bucket.start - base,
                            bucket.end - base, pinned)  # fmt: skip
                for p in bucket.pieces:
                    e = p.entry
                    part = device_staging[p.start - bucket.start : p.end - bucket.start].view(DTYPES[e.dtype])
                    lo = (p.start - e.offset) // part.element_size()
                    targets[e.name].view(-1)[lo : lo + part.numel()].copy_(part)  # the cast, on the device
            if ring is not None:
                ring.sent()
        if cuda:  # the one wait; after it the staging buffers may be reused and the version let go
            torch.cuda.current_stream(device).synchronize()
