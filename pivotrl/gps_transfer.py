"""How GPS bytes reach a GPU: page-locked host buffers and bucketed, non-blocking copies.

:meth:`pivotrl.gps.Snapshot.load_into` uses this on CUDA. The bookkeeping
(which ranges are registered, how bytes are cut into buckets) is plain Python
and tested on a CPU, the CUDA calls are injected into :class:`HostPins`.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pivotrl.gps import ALIGN, BUCKET_BYTES, DTYPES, PAGE, Snapshot, TensorEntry, _flat_tensor
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

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._users)


PINS = HostPins()  # this process's registrations


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


def _copy_bytes(dst: Tensor, flat: Tensor, start: int, end: int, pinned: tuple[int, int] | None) -> None:
    """``dst[:] = flat[start:end]``, split at the page-locked range so that each copy is wholly pinned or not.

    Non-blocking on CUDA either way: from page-locked memory the copy is a DMA
    that returns at once; from pageable memory CUDA stages the bytes before it
    returns, so the source is never read after this call.
    """
    cuts = {start, end}
    if pinned is not None:
        cuts |= {min(max(c, start), end) for c in pinned}
    edges = sorted(cuts)
    for a, b in zip(edges, edges[1:], strict=False):
        dst[a - start : b - start].copy_(flat[a:b], non_blocking=dst.is_cuda)


def _bytes_of(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.uint8)


def load_bucketed(snap: Snapshot, targets: dict[str, Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Copy ``snap`` into ``targets`` (stored name -> tensor, each once) as :meth:`Snapshot.load_into` does on a
    GPU. Works on any device (tests run it on a CPU); only CUDA gains from it."""
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
    pinned = PINS.pin(snap.buffer) if cuda else None
    flat = _flat_tensor(snap.buffer)
    buckets = plan_buckets(entries, bucket_bytes)
    staging: Tensor | None = None
    for bucket in buckets:
        if all(targets[p.entry.name].dtype == DTYPES[p.entry.dtype] for p in bucket.pieces):
            for p in bucket.pieces:  # no cast: straight into the parameters' bytes
                dst = _bytes_of(targets[p.entry.name])[p.start - p.entry.offset : p.end - p.entry.offset]
                _copy_bytes(dst, flat, p.start, p.end, pinned)
            continue
        if staging is None:
            staging = torch.empty(max(b.end - b.start for b in buckets), dtype=torch.uint8, device=device)
        _copy_bytes(staging[: bucket.end - bucket.start], flat, bucket.start, bucket.end, pinned)
        for p in bucket.pieces:
            e = p.entry
            src = staging[p.start - bucket.start : p.end - bucket.start].view(DTYPES[e.dtype])
            item = src.element_size()
            lo = (p.start - e.offset) // item
            targets[e.name].view(-1)[lo : lo + src.numel()].copy_(src)  # the cast, on the device
    if cuda:  # the one wait; after it the staging buffer may be reused and the buffer unregistered
        torch.cuda.current_stream(device).synchronize()
