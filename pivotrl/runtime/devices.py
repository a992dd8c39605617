"""Devices: the one module that says what a device is (``cuda`` or ``cpu``) and where it sits.

A *device* is one place a role runs: one Ray actor (or, for a one-device job,
this process). Its kind is decided once per job, from ``device`` and what the
devices will run on:

| ``device`` | GPUs where the devices run                | kind   |
| ---------- | ------------------------------------------ | ------ |
| ``auto``   | some (locally: torch sees CUDA; on a       | cuda   |
|            | cluster: it declares ``GPU`` resources)    |        |
| ``auto``   | none                                       | cpu    |
| ``cuda``   | some                                       | cuda   |
| ``cuda``   | none                                       | error  |
| ``cpu``    | any                                        | cpu    |

On Ray every device actor holds one bundle of a placement group packed per
node (strategy PACK, bundle ``d`` for device ``d``): ``{"CPU": 1, "GPU":
gpus_per_device}`` for a cuda device (a fraction below 1 puts several devices
on one GPU), ``{"CPU": 1}`` for a cpu device (whole CPUs only: fractional CPU
requests can leave actors pending forever).

**The placement follows the cluster; the compute follows torch.** A cuda
device holds its GPU share wherever it runs, but computes on CUDA only where
its torch sees CUDA; under ``device=auto`` one that does not (a cluster that
declares GPUs its torch cannot use, as ``ray start --num-gpus 4`` on a CPU
machine does) computes on the CPU, so the whole GPU-placement path can be
exercised without a GPU. Under ``device=cuda`` the same device is an error
(``check_bindings``): the user asked for CUDA compute.

Threads: ``threads_per_device`` torch threads per device, or by default the
cores of the node shared among the devices placed on it (at least one).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pivotrl.errors import UserError

Kind = Literal["cuda", "cpu"]
CUDA: Kind = "cuda"
CPU: Kind = "cpu"
LOOPBACK = "127.0.0.1"


def resolve(requested: str, gpus: float, where: str = "this machine") -> Kind:
    """The devices' kind from the ``device`` key and the GPUs where they run (``where`` names that place
    in the error: this machine, or the cluster at an address)."""
    if requested == CPU:
        return CPU
    if gpus > 0:
        return CUDA
    if requested == CUDA:
        raise UserError(f"device=cuda: {where} has no CUDA GPU; use device=auto or device=cpu")
    return CPU


def local_gpus() -> int:
    """CUDA GPUs torch can use in this process (0 for a CPU build of torch or without a driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def shares_gpu(kind: str, gpus_per_device: float, devices: int) -> bool:
    """Several devices on one GPU (``gpus_per_device`` below 1): their train group cannot be NCCL's, which takes
    one rank per GPU (``TrainGroup``'s ``staged``)."""
    return kind == CUDA and gpus_per_device < 1 and devices > 1


def bundle(kind: Kind, gpus_per_device: float) -> dict[str, float]:
    """What one device actor reserves on its node."""
    return {"CPU": 1, "GPU": gpus_per_device} if kind == CUDA else {"CPU": 1}


def process_share(gpus_per_device: float, processes: int) -> float:
    """The GPU share each of a device's ``processes`` asks Ray for: an equal part of the device's bundle, rounded
    down to Ray's resolution (1e-4), so that together they fit it. The share is a placement rule only: the
    processes take turns on the memory (one role at a time is awake)."""
    if processes < 1:
        raise ValueError(f"a device runs at least one process, not {processes}")
    return int(round(gpus_per_device * 10_000 / processes, 6)) / 10_000


def bundles(kind: Kind, devices: int, gpus_per_device: float) -> list[dict[str, float]]:
    """The placement group of a job: one bundle per device, bundle ``d`` for device ``d``."""
    return [bundle(kind, gpus_per_device) for _ in range(devices)]


def shortfall(wanted: Sequence[Mapping[str, float]], total: Mapping[str, float]) -> dict[str, float]:
    """Resources the bundles need beyond what the cluster has in all (empty when the totals suffice; whether
    each bundle fits on one node is the placement group's to find)."""
    need: Counter[str] = Counter()
    for b in wanted:
        need.update(b)
    return {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}


def thread_shares(nodes: Sequence[str], node_cores: Mapping[str, int], threads_per_device: int = 0) -> list[int]:
    """Torch threads for each device, ``nodes[d]`` being the node device ``d`` runs on: ``threads_per_device``
    when set, else the node's cores shared evenly among the devices on it, at least one each."""
    if threads_per_device > 0:
        return [threads_per_device] * len(nodes)
    on_node = Counter(nodes)
    return [max(1, node_cores.get(n, 1) // on_node[n]) for n in nodes]


@dataclass(frozen=True, slots=True)
class Binding:
    """What a device actor holds, as it sees it (reported for logs and tests)."""

    device: int
    bundle: int | None  # its bundle in the job's placement group
    placement_group: str | None  # that group's id
    node_ip: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned it
    cuda_visible_devices: str | None
    kind: Kind  # what it computes on
    threads: int
    memory_bytes: int = 0  # its GPU's memory (0: it computes on the CPU)
    bf16: bool = True  # its GPU computes in bfloat16 (``bf16_supported``; True on a CPU: no GPU's limit)


def bind(kind: Kind) -> Kind:
    """Bind this process to its device and say what it computes on: a cuda device computes on the one GPU
    Ray made visible to it (``CUDA_VISIBLE_DEVICES`` lists only its own), if torch sees it; see the
    module's rule for one that does not."""
    import torch

    if kind == CUDA and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return CUDA
    return CPU


def gpu_memory() -> int:
    """Bytes of memory of the GPU this process is bound to (``bind``): what a device's trainer may plan with."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def bf16_supported() -> bool:
    """Whether the GPU this process is bound to (``bind``) computes in bfloat16: compute capability 8.0 or
    above (``torch.cuda.is_bf16_supported(including_emulation=False)``), the line vLLM draws too
    (``supported_dtypes`` and ``check_if_supports_dtype`` in ``vllm/platforms/cuda.py``). Below it torch would
    emulate bfloat16, slowly; that does not count."""
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False)


def check_bindings(requested: str, wanted: Kind, bindings: Sequence[Binding]) -> None:
    """Under ``device=cuda`` every device must compute on CUDA; name the first that cannot."""
    if requested != CUDA or wanted != CUDA:
        return
    for b in bindings:
        if b.kind != CUDA:
            raise UserError(
                f"device=cuda: device {b.device} on node {b.node_ip} holds GPU {','.join(b.gpu_ids) or '?'} "
                "but its torch sees no CUDA (a CPU build of torch, or no driver there); use device=auto or device=cpu"
            )


def node_address() -> str:
    """The address of the node this process runs on, as the cluster knows it: the address other nodes reach
    it at (a trainer's rendezvous listens there). Outside Ray, the loopback address."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    return LOOPBACK


def enable_cluster_token() -> bool:
    """Use token auth to join a cluster when a token is at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token) and RAY_AUTH_MODE is not set: ``ray start --head`` turns token auth on when it
    finds a token, but a client sends its token only with RAY_AUTH_MODE=token, and Ray reads that variable
    once, when it is imported. Call this before anything imports ray; later, the cached setting is
    refreshed as Ray's own token setup does. A token sent to a cluster without auth does no harm. Returns
    whether token auth is on."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    token_file = Path(path) if path else Path.home() / ".ray" / "auth_token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray" in sys.modules:
        from ray._raylet import Config

        Config.initialize("")
    return True
