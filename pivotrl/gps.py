"""Global Parameter Storage: versioned weights and optimizer state in host memory.

Any device can take up any role by loading what it needs from here instead of
from disk or from another device: the trainer publishes policy version v+1,
rollout devices fetch it, a device leaving the train role parks the optimizer
state here and whichever device takes the role next picks it up.

Layout. One published version is ONE flat, 64-byte aligned ``uint8`` buffer
plus a :class:`Manifest` (name, dtype, shape, offset, nbytes per tensor, and
small picklable metadata). Packing copies each tensor once into its slice of a
preallocated buffer (no ``torch.cat``, so no second full-size temporary).
Fetching returns zero-copy torch views into that buffer; the one real copy is
:meth:`Snapshot.load_into` into a model's existing parameters - the cost of
bringing a version onto a device.

On a GPU that copy runs at host-to-device bandwidth: the bytes move in
buckets of tens of MB through a page-locked staging buffer the process keeps
(:class:`pivotrl.gps_transfer.Staging`: locked once, reused by every load,
two buckets small), non-blocking, with dtype conversion done on the device
(fp32 stored, bf16 rollout) and one synchronize at the end. On a CPU: a
``copy_`` per tensor. Nothing here touches CUDA in a process that never loads
into a GPU.

Two backends share the :class:`ParameterStore` protocol:

* :class:`LocalStore` - a dict of numpy buffers in this process (one-process
  runs, tests, the simulator's real-weights mode).
* :class:`RayStore` - buffers in Ray's object store, indexed by a named
  :class:`GPSDirectory` actor. Reads inside a node map the shared-memory
  object (zero-copy); Ray moves the bytes between nodes.

One host copy per publish in Ray. The publisher packs the version into a
buffer its process keeps (a device's: ``gps_transfer.publish_staging``;
page-locked on a GPU, where the bytes arrive by DMA, no pass of the CPU over
them) and ``ray.put`` s it: the object store's memcpy is the one host copy.
The directory is handed the ref, never the bytes (no argument staging, no
second put). A Ray object belongs to the process that created it and is lost
with it, whoever holds a reference (``ray.get`` raises ``OwnerDiedError``;
``ray.put(..., _owner=...)``, which handed ownership over, was removed in Ray
2.56). So the directory keeps a zero-copy view of each version (a mapping of
the same shared memory: it keeps the bytes in the store after their owner
dies), and a fetch that finds the publisher dead asks the directory to adopt
the version: it puts the bytes again from its view and owns the copy. That
copy is paid once per version whose publisher died, not per publish; a
version outlives its publisher for as long as the directory lives (create
the directory from a long-lived process, the driver: an actor dies with its
owner). Across nodes the directory's view is a replica on its own node.

Costs (benchmarks/gps.py): a fetch-and-load runs at 0.8-0.95x a plain memcpy
for 100M-parameter models. Preallocate Ray's object store
(``_system_config={"preallocate_plasma_memory": True}``, as the job's local
instance does, sized by ``pivotrl.gps_sizing``): otherwise each publish into a
fresh part of the store pays a page fault per 4 KiB (10x slower publishes
measured). Keep torch's OpenMP threads below the free cores of the process
doing ``load_into`` (Ray workers default to one).

Versions are immutable and always named: publishing an existing
(model, version, kind) raises, and fetching an absent one raises
:class:`VersionError` listing what exists. Nothing ever falls back to
"latest", so a device never serves weights of a version it did not ask for.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn

from pivotrl.log import logger
from pivotrl.model.experts import checkpoint_parts, copy_span

if TYPE_CHECKING:
    from ray.actor import ActorHandle

ALIGN = 64  # bytes; cache-line and object-store alignment, and a multiple of every element size
PAGE = mmap.PAGESIZE  # host buffers start on a page, so all of them but the last partial page can be page-locked
BUCKET_BYTES = 32 * 2**20  # staging buffer of a casting load_into on a GPU (see gps_transfer)
TOTAL = "total"  # key of the grand total in memory(); therefore not a valid model name

_DTYPE_NAMES = "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool float8_e4m3fn float8_e5m2".split()
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


class Kind(StrEnum):
    """What a stored version holds; weights and optimizer state of one version are separate entries."""

    WEIGHTS = "weights"
    OPTIMIZER = "optimizer"


class VersionError(LookupError):
    """A (model, version, kind) that is absent when asked for, or already present when published."""


class LoadError(ValueError):
    """A snapshot that does not fit the module or optimizer it is loaded into; the message lists the mismatches."""


# ---------------------------------------------------------------------------------------------------------------------
# Manifest, packing, zero-copy views


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int  # byte offset in the buffer, ALIGN-aligned
    nbytes: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to read a buffer back, plus small non-tensor metadata (e.g. optimizer hyperparameters)."""

    model_name: str
    version: int
    kind: Kind
    entries: tuple[TensorEntry, ...]
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PublishInfo:
    """What a publish cost the publisher; the trainer reports it as part of each step's publish phase."""

    nbytes: int
    seconds: float  # pack + store, as seen by the publisher
    # passes of the host's CPU over the version's bytes: the pack's copies out of host memory (a GPU's bytes
    # arriving by DMA in page-locked memory are none) plus the object store's memcpy
    host_copies: float = 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in the GPS; supported: {', '.join(DTYPES)}")
    return name


def _aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array whose first byte is ``align``-aligned (numpy only promises 16)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


@dataclass(frozen=True, slots=True)
class Deferred:
    """A tensor to publish that is made only when ``pack`` copies it, and dropped right after: a parameter
    gathered from its shards, or cast on its device. Its dtype and shape are declared, so the buffer is laid
    out first; a publish of such tensors then holds one at a time, and copies it once, into the buffer
    (from a GPU too), instead of first into a host copy of the whole model. ``make`` may return another
    dtype than ``dtype``: the copy casts. Each one's ``make`` is called exactly once, in order."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], Tensor]

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def element_size(self) -> int:
        return self.dtype.itemsize


def cast(t: Tensor, dtype: torch.dtype) -> Tensor | Deferred:
    """``t`` to publish as ``dtype``, with no whole copy made beforehand: as it is where it has the dtype, else
    cast as ``pack`` copies it, on its GPU (a blocking copy to the host would cast on the CPU, after moving
    the wider dtype's bytes) or, on a CPU, in that copy itself."""
    if t.dtype == dtype:
        return t
    return Deferred(dtype, tuple(t.shape), lambda: t if t.device.type == "cpu" else t.to(dtype))


def layout(tensors: Mapping[str, Tensor | Deferred]) -> tuple[tuple[TensorEntry, ...], int]:
    """Byte layout of ``tensors`` in insertion order: entries and total buffer size."""
    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(t, Tensor | Deferred):
            raise TypeError(f"GPS tensors must be torch.Tensor; {name!r} is {type(t).__name__}")
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, _dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return tuple(entries), offset


def _typed_view(flat: Tensor, entry: TensorEntry) -> Tensor:
    raw = flat[entry.offset : entry.offset + entry.nbytes]
    return raw.view(DTYPES[entry.dtype]).view(entry.shape)


def _flat_tensor(buffer: np.ndarray) -> Tensor:
    # Object-store buffers are read-only mappings. torch has no read-only tensors and warns; the views are
    # read-only by contract (see Snapshot), so the warning carries no information here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(buffer)


def pack(tensors: Mapping[str, Tensor | Deferred]) -> tuple[np.ndarray, tuple[TensorEntry, ...]]:
    """Copy ``tensors`` (any device, any strides; ``Deferred`` ones made as their turn comes) into one new
    flat buffer: one copy per tensor."""
    buffer, entries, _ = _pack(tensors)
    return buffer, entries


def _pack(
    tensors: Mapping[str, Tensor | Deferred], out: np.ndarray | None = None, pinned: bool = False
) -> tuple[np.ndarray, tuple[TensorEntry, ...], int]:
    """:func:`pack` into ``out`` (exactly the layout's size; a new buffer when None), which is page-locked where
    ``pinned``; also the bytes the host's CPU copied: those of tensors in host memory, and those of a GPU's
    tensors unless they land in page-locked memory by DMA (same dtype; into pageable memory CUDA stages them
    through a buffer of its own, a host copy)."""
    entries, nbytes = layout(tensors)
    if out is None:
        out = _aligned_empty(nbytes, PAGE)  # page-aligned: its pages are its own, so it can be page-locked whole
    elif out.nbytes != nbytes or not out.flags.writeable:
        raise ValueError(f"pack: a writable buffer of {nbytes} bytes is needed, got {out.nbytes} bytes")
    flat = torch.from_numpy(out)
    end = host = 0
    with torch.no_grad():
        for entry, t in zip(entries, tensors.values(), strict=True):
            out[end : entry.offset] = 0  # padding too, so equal tensors give equal bytes
            if isinstance(t, Deferred):
                t = t.make()
                if tuple(t.shape) != entry.shape:
                    raise ValueError(f"{entry.name!r}: made a tensor of shape {tuple(t.shape)}, declared {entry.shape}")
            view = _typed_view(flat, entry)
            if not (t.is_cuda and pinned and t.dtype == view.dtype):
                host += entry.nbytes
            view.copy_(t.detach())
            del t
            end = entry.offset + entry.nbytes
    out.flags.writeable = False  # published bytes are immutable
    return out, entries, host


def unpack(buffer: np.ndarray, entries: Iterable[TensorEntry]) -> dict[str, Tensor]:
    """Zero-copy views of every tensor in ``buffer``; they alias it and must not be written."""
    flat = _flat_tensor(buffer)
    return {e.name: _typed_view(flat, e) for e in entries}


# ---------------------------------------------------------------------------------------------------------------------
# Snapshot: one fetched version


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """A module's persistent state by name, each tensor once (tied weights keep their first name).

    This is what to publish for a model: ``state_dict`` would store a tied
    ``lm_head.weight`` twice.
    """
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach()
    return out


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A fetched version: the manifest, the stored buffer and zero-copy tensor views into it.

    The views alias the stored bytes: writing into them would change a
    published version (LocalStore) or fault on a read-only mapping (RayStore).
    Use :meth:`load_into`, or ``state_dict(copy=True)`` for tensors you own.
    Holding a snapshot keeps its buffer alive even after the version is freed.
    """

    manifest: Manifest
    buffer: np.ndarray
    tensors: dict[str, Tensor]

    @classmethod
    def of(cls, manifest: Manifest, buffer: np.ndarray) -> Snapshot:
        if buffer.nbytes != manifest.nbytes:
            raise ValueError(f"buffer of {buffer.nbytes} bytes does not match its manifest ({manifest.nbytes} bytes)")
        return cls(manifest, buffer, unpack(buffer, manifest.entries))

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    def state_dict(self, copy: bool = False) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.tensors.items()} if copy else dict(self.tensors)

    def pin(self) -> bool:
        """Page-lock this version's buffer for CUDA in place (once per process and buffer; see
        ``gps_transfer.HostPins``), for a caller that holds the snapshot and loads it several times.

        :meth:`load_into` then copies straight from it instead of through the
        process's staging buffer. False without CUDA or when the memory cannot
        be registered (loads then go through the staging buffer).
        """
        from pivotrl.gps_transfer import PINS

        return torch.cuda.is_available() and PINS.pin(self.buffer) is not None

    def load_into(self, module: nn.Module, *, bucketed: bool | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        """Copy this version into ``module``'s existing tensors in place, on their device.

        Strict: every tensor of the module must be covered and every stored
        name must exist with the same shape. Tied tensors need only one of
        their names. Dtypes may differ (the module's dtype wins, e.g. fp32
        master weights into a bf16 rollout copy).

        On a GPU (``bucketed`` None means: when every tensor is on one CUDA
        device) every copy is a non-blocking host-to-device copy from
        page-locked memory (the process's staging buffer, a bucket at a time:
        ``gps_transfer.load_bucketed``). Tensors whose dtype matches go straight into the
        parameters' bytes (large ones in pieces of ``bucket_bytes``). Tensors
        to convert travel in buckets of about ``bucket_bytes`` (small tensors
        together) into a staging buffer on the device, and are cast from there
        into the parameters: converting fp32 to bf16 then costs the GPU
        microseconds instead of the CPU a pass over the bytes, and only the
        stored bytes cross the bus. One synchronize at the end: when this
        returns the weights are in place. On a CPU, one ``copy_`` per tensor.
        """
        targets = module.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for name, t in targets.items():
            groups.setdefault(id(t), []).append(name)
        unexpected = [n for n in self.tensors if n not in targets]
        shapes = [
            f"{n}: stored {tuple(v.shape)} vs module {tuple(targets[n].shape)}"
            for n, v in self.tensors.items()
            if n in targets and v.shape != targets[n].shape
        ]
        missing = [names[0] for names in groups.values() if not any(n in self.tensors for n in names)]
        if unexpected or missing or shapes:
            m = self.manifest
            raise LoadError(
                f"{m.model_name} v{m.version} ({m.kind}) does not fit {type(module).__name__}: "
                f"missing {missing}, unexpected {unexpected}, shape mismatches {shapes}"
            )
        done: set[int] = set()
        todo: dict[str, Tensor] = {}  # stored name -> target, each target once
        for name in self.tensors:
            if id(targets[name]) not in done:
                done.add(id(targets[name]))
                todo[name] = targets[name]
        devices = {t.device for t in todo.values()}
        if bucketed is None:
            bucketed = len(devices) == 1 and next(iter(devices)).type == "cuda"
        with torch.no_grad():
            if bucketed:
                from pivotrl.gps_transfer import load_bucketed  # here: gps_transfer imports this module

                load_bucketed(self, todo, bucket_bytes)
            else:
                for name, target in todo.items():
                    target.copy_(self.tensors[name])


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer state <-> flat tensors by parameter name


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def optimizer_tensors(optimizer: torch.optim.Optimizer, module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Flatten an optimizer's state against ``module``'s parameter names: ``(tensors, meta)``.

    Names, not the optimizer's positional ids, key the state, so another
    process can rebuild it for its own copy of the module. Tensors are
    ``state.{param}.{key}`` (e.g. ``exp_avg``); hyperparameters, non-tensor
    state and the name order go into ``meta``.
    """
    names = _param_names(module)
    sd = optimizer.state_dict()
    index_name: dict[int, str] = {}
    groups: list[dict[str, Any]] = []
    for saved, live in zip(sd["param_groups"], optimizer.param_groups, strict=True):
        for index, p in zip(saved["params"], live["params"], strict=True):
            if id(p) not in names:
                raise LoadError(f"optimizer holds a parameter of shape {tuple(p.shape)} that the module does not own")
            index_name[index] = names[id(p)]
        groups.append({**saved, "params": [index_name[i] for i in saved["params"]]})
    tensors: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, values in sd["state"].items():
        name = index_name[index]
        state[name] = {}
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"state.{name}.{key}"] = value.detach()
                state[name][key] = None  # stored as a tensor
            else:
                state[name][key] = value
    meta = {"optimizer": type(optimizer).__name__, "param_groups": groups, "state": state}
    return tensors, meta


def load_optimizer_state(snapshot: Snapshot, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Restore state flattened by :func:`optimizer_tensors` into ``optimizer`` (built over ``module``).

    Each state tensor is copied once, straight onto its parameter's device, so
    the optimizer never aliases the read-only stored bytes.
    """
    meta = snapshot.manifest.meta
    if meta.get("optimizer") != type(optimizer).__name__:
        raise LoadError(f"stored state is for {meta.get('optimizer')!r}, not {type(optimizer).__name__}")
    names = _param_names(module)
    params = dict(module.named_parameters())
    saved_groups = meta["param_groups"]
    live_groups = optimizer.param_groups
    if len(saved_groups) != len(live_groups):
        raise LoadError(f"stored state has {len(saved_groups)} param groups, optimizer has {len(live_groups)}")
    groups, index = [], {}
    stored: dict[str, list[str]] = {}  # a parameter's names in the stored state: its own, or its experts' tensors
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups, strict=True)):
        live_names = [names.get(id(p), "<not in module>") for p in live["params"]]
        if live_names != saved["params"]:  # state written with one parameter per expert: the tensors' names
            parts = {n: [p.name for p in checkpoint_parts(n, params[n].shape)] for n in live_names if n in params}
            if len(parts) < len(live_names) or sorted(saved["params"]) != sorted(x for v in parts.values() for x in v):
                raise LoadError(f"param group {g}: stored parameters {saved['params']} vs optimizer's {live_names}")
            stored |= parts
        for name in live_names:
            index[name] = len(index)
        groups.append({**saved, "params": [index[n] for n in live_names]})
    state: dict[int, dict[str, Any]] = {}
    for name in index:
        sources = stored.get(name, [name])
        if sources[0] not in meta["state"]:
            continue
        param = params[name]
        entry: dict[str, Any] = {}
        for key, value in meta["state"][sources[0]].items():
            if value is not None:
                entry[key] = value
                continue
            view = snapshot.tensors[f"state.{sources[0]}.{key}"]
            if len(sources) > 1 and view.dim() > 0:  # the experts' tensors, stacked as the parameter is
                entry[key] = torch.empty(param.shape, dtype=view.dtype, device=param.device)
                tensors = {n: snapshot.tensors[f"state.{n}.{key}"] for n in sources}
                copy_span(entry[key].view(-1), tensors, name, param.shape, 0)
                continue
            device = param.device if view.shape == param.shape else view.device  # scalars such as step stay put
            entry[key] = torch.empty(view.shape, dtype=view.dtype, device=device).copy_(view)
        state[index[name]] = entry
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------------------------------
# The store interface and its bookkeeping


Key = tuple[str, int, Kind]


def _check_name(model_name: str) -> str:
    if not isinstance(model_name, str) or not model_name or model_name == TOTAL:
        raise ValueError(f"model_name must be a non-empty string other than {TOTAL!r}; got {model_name!r}")
    return model_name


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0; got {version!r}")
    return version


def _check_keep_last(keep_last: int) -> int:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last must be an int >= 0; got {keep_last!r}")
    return keep_last


def _key(model_name: str, version: int, kind: Kind | str) -> Key:
    try:
        kind = Kind(kind)
    except ValueError:
        raise ValueError(f"kind must be one of {[k.value for k in Kind]}; got {kind!r}") from None
    return _check_name(model_name), _check_version(version), kind


def _absent(key: Key, available: list[int]) -> VersionError:
    name, version, kind = key
    have = f"available: {available}" if available else "none published"
    return VersionError(f"model {name!r} has no {kind.value} version {version} ({have})")


def _duplicate(key: Key) -> VersionError:
    name, version, kind = key
    return VersionError(f"model {name!r} {kind.value} version {version} is already published; versions are immutable")


@runtime_checkable
class ParameterStore(Protocol):
    """What every GPS backend offers; contract tests run against each."""

    def publish(
        self,
        model_name: str,
        version: int,
        tensors: Mapping[str, Tensor | Deferred],
        kind: Kind | str = Kind.WEIGHTS,
        meta: Mapping[str, Any] | None = None,
    ) -> PublishInfo: ...

    def fetch(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> Snapshot: ...

    def latest(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> int | None: ...

    def versions(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> list[int]: ...

    def free(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> None: ...

    def retain(self, model_name: str, keep_last: int, kind: Kind | str = Kind.WEIGHTS) -> list[int]: ...

    def memory(self) -> dict[str, int]: ...


class _Index:
    """Keys -> (manifest, stored object) with the immutability rules; shared by both backends.

    Thread-safe: a trainer thread may publish while rollout threads fetch, and
    the Ray directory serves calls concurrently.
    """

    def __init__(self) -> None:
        self._items: dict[Key, tuple[Manifest, Any]] = {}
        self._pending: set[Key] = set()
        self._lock = threading.Lock()

    def reserve(self, key: Key) -> None:
        with self._lock:
            if key in self._items or key in self._pending:
                raise _duplicate(key)
            self._pending.add(key)

    def commit(self, key: Key, manifest: Manifest, obj: Any) -> None:
        with self._lock:
            self._pending.discard(key)
            self._items[key] = (manifest, obj)

    def abandon(self, key: Key) -> None:
        with self._lock:
            self._pending.discard(key)

    def swap(self, key: Key, obj: Any) -> None:
        """The stored object of ``key`` replaced (the same bytes, held another way)."""
        with self._lock:
            if key not in self._items:
                raise _absent(key, self._versions(key[0], key[2]))
            self._items[key] = (self._items[key][0], obj)

    def get(self, key: Key) -> tuple[Manifest, Any]:
        with self._lock:
            if key not in self._items:
                raise _absent(key, self._versions(key[0], key[2]))
            return self._items[key]

    def _versions(self, model_name: str, kind: Kind) -> list[int]:
        return sorted(v for n, v, k in self._items if n == model_name and k == kind)

    def versions(self, model_name: str, kind: Kind) -> list[int]:
        with self._lock:
            return self._versions(model_name, kind)

    def free(self, key: Key) -> None:
        with self._lock:
            if key not in self._items:
                raise _absent(key, self._versions(key[0], key[2]))
            del self._items[key]

    def retain(self, model_name: str, kind: Kind, keep_last: int) -> list[int]:
        _check_keep_last(keep_last)
        with self._lock:
            have = self._versions(model_name, kind)
            old = have[: max(len(have) - keep_last, 0)]
            for v in old:
                del self._items[(model_name, v, kind)]
            return old

    def memory(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for (name, _, _), (manifest, _) in self._items.items():
                out[name] = out.get(name, 0) + manifest.nbytes
            out[TOTAL] = sum(out.values())
            return out


def _manifest(key: Key, entries: tuple[TensorEntry, ...], nbytes: int, meta: Mapping[str, Any] | None) -> Manifest:
    return Manifest(key[0], key[1], key[2], entries, nbytes, dict(meta or {}))


# ---------------------------------------------------------------------------------------------------------------------
# LocalStore


def _published(key: Key, nbytes: int, start: float, host_bytes: float) -> PublishInfo:
    info = PublishInfo(nbytes, time.perf_counter() - start, host_bytes / nbytes if nbytes else 0.0)
    logger.debug("gps: published %s %s v%d, %d bytes in %.3f s", key[0], key[2], key[1], info.nbytes, info.seconds)
    return info


class _Latest:
    """``latest`` from ``versions``, the same for every backend."""

    def versions(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> list[int]:
        raise NotImplementedError

    def latest(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> int | None:
        have = self.versions(model_name, kind)
        return have[-1] if have else None


class LocalStore(_Latest):
    """Buffers in this process; fetch returns views of the stored buffer itself."""

    def __init__(self) -> None:
        self._index = _Index()

    def publish(
        self,
        model_name: str,
        version: int,
        tensors: Mapping[str, Tensor | Deferred],
        kind: Kind | str = Kind.WEIGHTS,
        meta: Mapping[str, Any] | None = None,
    ) -> PublishInfo:
        key = _key(model_name, version, kind)
        start = time.perf_counter()
        self._index.reserve(key)
        try:
            buffer, entries, host = _pack(tensors)
        except BaseException:
            self._index.abandon(key)
            raise
        self._index.commit(key, _manifest(key, entries, buffer.nbytes, meta), buffer)
        return _published(key, buffer.nbytes, start, host)

    def fetch(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> Snapshot:
        manifest, buffer = self._index.get(_key(model_name, version, kind))
        return Snapshot.of(manifest, buffer)

    def versions(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> list[int]:
        name, _, kind = _key(model_name, 0, kind)
        return self._index.versions(name, kind)

    def free(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> None:
        self._index.free(_key(model_name, version, kind))

    def retain(self, model_name: str, keep_last: int, kind: Kind | str = Kind.WEIGHTS) -> list[int]:
        name, _, kind = _key(model_name, 0, kind)
        return self._index.retain(name, kind, keep_last)

    def memory(self) -> dict[str, int]:
        return self._index.memory()


# ---------------------------------------------------------------------------------------------------------------------
# RayStore


@dataclass(frozen=True, slots=True)
class _Held:
    """A version as the directory holds it: the ref fetchers get, and while its publisher owns the object, a
    zero-copy view of its bytes (what keeps them in the store should the publisher die; see the module)."""

    ref: Any
    view: np.ndarray | None = None  # None once this actor owns the object


class GPSDirectory:
    """Ray actor (see :meth:`RayStore.create`): maps keys to the refs of published objects, and keeps every
    version readable after its publisher dies (:meth:`adopt`).

    Methods return error messages instead of raising so that callers raise a
    plain :class:`VersionError` rather than a wrapped remote traceback.
    Runs threaded (``max_concurrency``), so a large publish does not hold up fetches.
    """

    def __init__(self) -> None:
        self._index = _Index()
        self._adopting = threading.Lock()

    def put(self, key: Key, manifest: Manifest, refs: list[Any]) -> str | None:
        """Index the object the publisher put (``refs[0]``, passed in a list so that it arrives as a ref)."""
        import ray

        try:
            self._index.reserve(key)
        except VersionError as e:
            return str(e)
        try:
            view = ray.get(refs[0])  # on this node a mapping of the same shared memory: no copy
        except BaseException:
            self._index.abandon(key)
            raise
        self._index.commit(key, manifest, _Held(refs[0], view))
        return None

    def get(self, key: Key) -> tuple[Manifest | None, list[Any], str | None]:
        try:
            manifest, held = self._index.get(key)
        except VersionError as e:
            return None, [], str(e)
        return manifest, [held.ref], None  # a ref inside a list reaches the caller as a ref (a borrow), not its value

    def adopt(self, key: Key) -> tuple[Manifest | None, list[Any], str | None]:
        """``key``'s publisher died with the object it owned: put the bytes again from the view held, so that
        this actor owns them from now on; then as :meth:`get`."""
        import ray

        with self._adopting:  # (fetchers that found the owner dead at once: one copy)
            try:
                manifest, held = self._index.get(key)
            except VersionError as e:
                return None, [], str(e)
            if held.view is not None:
                held = _Held(ray.put(held.view))
                self._index.swap(key, held)
                logger.warning("gps: %s %s v%d outlived its publisher; the directory holds it now", key[0],
                               key[2].value, key[1])  # fmt: skip
        return manifest, [held.ref], None

    def versions(self, model_name: str, kind: Kind) -> list[int]:
        return self._index.versions(model_name, kind)

    def free(self, key: Key) -> str | None:
        try:
            self._index.free(key)
        except VersionError as e:
            return str(e)
        return None

    def retain(self, model_name: str, kind: Kind, keep_last: int) -> list[int]:
        return self._index.retain(model_name, kind, keep_last)

    def memory(self) -> dict[str, int]:
        return self._index.memory()


class RayStore(_Latest):
    """GPS in Ray's object store. Picklable: hand it to actors, which then publish and fetch themselves.

    Create the directory once from the driver with :meth:`create`; workers use
    the same object or :meth:`connect` by name.
    """

    def __init__(self, directory: ActorHandle, name: str) -> None:
        self.directory = directory
        self.name = name

    @classmethod
    def create(cls, name: str = "pivotrl-gps", *, detached: bool = False, max_concurrency: int = 8) -> RayStore:
        """Start the directory actor. It dies with its creator unless ``detached`` (then :meth:`shutdown` it)."""
        import ray

        actor = ray.remote(GPSDirectory).options(
            name=name,
            num_cpus=0,  # bookkeeping only; a fractional or whole CPU would compete with real work
            max_concurrency=max_concurrency,
            lifetime="detached" if detached else None,
        )
        try:
            return cls(actor.remote(), name)
        except ValueError as e:
            raise ValueError(f"cannot create GPS directory {name!r}: {e}") from e

    @classmethod
    def connect(cls, name: str = "pivotrl-gps") -> RayStore:
        import ray

        try:
            return cls(ray.get_actor(name), name)
        except ValueError:
            raise ValueError(f"no GPS directory named {name!r}; create it first with RayStore.create") from None

    def shutdown(self) -> None:
        """Kill the directory; every version it holds is released."""
        import ray

        ray.kill(self.directory)

    def publish(
        self,
        model_name: str,
        version: int,
        tensors: Mapping[str, Tensor | Deferred],
        kind: Kind | str = Kind.WEIGHTS,
        meta: Mapping[str, Any] | None = None,
    ) -> PublishInfo:
        import ray

        from pivotrl.gps_transfer import publish_staging

        key = _key(model_name, version, kind)
        start = time.perf_counter()
        staging = publish_staging()
        nbytes = layout(tensors)[1]
        with staging.hold(nbytes) if staging is not None else contextlib.nullcontext(None) as out:
            buffer, entries, host = _pack(tensors, out, pinned=staging is not None and staging.pinned)
            ref = ray.put(buffer)  # the one copy into the object store; this process owns the object
            del buffer
        error = ray.get(self.directory.put.remote(key, _manifest(key, entries, nbytes, meta), [ref]))
        if error is not None:
            raise VersionError(error)
        return _published(key, nbytes, start, host + nbytes)

    def fetch(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> Snapshot:
        import ray

        key = _key(model_name, version, kind)
        manifest, refs, error = ray.get(self.directory.get.remote(key))
        if error is not None:
            raise VersionError(error)
        try:
            buffer = ray.get(refs[0])  # same node: a read-only view of shared memory
        except ray.exceptions.ObjectLostError:  # its publisher died: the directory takes the bytes over
            manifest, refs, error = ray.get(self.directory.adopt.remote(key))
            if error is not None:
                raise VersionError(error) from None
            buffer = ray.get(refs[0])
        return Snapshot.of(manifest, buffer)

    def versions(self, model_name: str, kind: Kind | str = Kind.WEIGHTS) -> list[int]:
        import ray

        name, _, kind = _key(model_name, 0, kind)
        return ray.get(self.directory.versions.remote(name, kind))

    def free(self, model_name: str, version: int, kind: Kind | str = Kind.WEIGHTS) -> None:
        import ray

        error = ray.get(self.directory.free.remote(_key(model_name, version, kind)))
        if error is not None:
            raise VersionError(error)

    def retain(self, model_name: str, keep_last: int, kind: Kind | str = Kind.WEIGHTS) -> list[int]:
        import ray

        name, _, kind = _key(model_name, 0, kind)
        return ray.get(self.directory.retain.remote(name, kind, _check_keep_last(keep_last)))

    def memory(self) -> dict[str, int]:
        import ray

        return ray.get(self.directory.memory.remote())


# ---------------------------------------------------------------------------------------------------------------------
# Convenience for the two things roles actually do


def publish_model(store: ParameterStore, model_name: str, version: int, module: nn.Module) -> PublishInfo:
    return store.publish(model_name, version, module_tensors(module), Kind.WEIGHTS)


def publish_optimizer(
    store: ParameterStore, model_name: str, version: int, optimizer: torch.optim.Optimizer, module: nn.Module
) -> PublishInfo:
    tensors, meta = optimizer_tensors(optimizer, module)
    return store.publish(model_name, version, tensors, Kind.OPTIMIZER, meta)


def restore_optimizer(
    store: ParameterStore, model_name: str, version: int, optimizer: torch.optim.Optimizer, module: nn.Module
) -> None:
    load_optimizer_state(store.fetch(model_name, version, Kind.OPTIMIZER), optimizer, module)
