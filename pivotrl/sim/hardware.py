"""Accelerators the simulator models: the few numbers a roofline needs, each with its public source.

Bandwidths are one direction (what one transfer gets); NVIDIA datasheets quote
NVLink and PCIe as the sum of both directions, so those figures are halved here.
Peak FLOP/s are dense bf16: datasheets quote tensor-core figures "with sparsity"
(2:4 structured), twice the dense rate that LLM matmuls reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

GB = 1e9  # bandwidths: decimal, as datasheets quote them
MiB = 2**20  # HBM capacities: binary, as the driver reports them


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator and its links. Bytes and bytes/s throughout."""

    name: str
    peak_flops: float  # bf16 tensor-core FLOP/s, dense
    hbm_bw: float  # HBM bytes/s
    hbm_bytes: float  # HBM capacity
    h2d_bw: float  # host-to-device bytes/s, one direction (PCIe)
    nvlink_bw: float  # bytes/s one GPU sends to the others of its node, one direction
    network_bw: float  # inter-node bytes/s per GPU, one direction (one NIC per GPU)
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (not value > 0 or math.isinf(value)):
                raise ValueError(f"GPU {self.name!r}: {f.name} got {value!r}, must be a finite number > 0")

    def link_bw(self, group: int) -> float:
        """Per-GPU bandwidth of a collective over ``group`` GPUs: NVLink inside a node, the network beyond."""
        return self.nvlink_bw if group <= self.gpus_per_node else self.network_bw


GPUS: dict[str, GPU] = {
    "H100": GPU(
        name="H100",
        # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense
        peak_flops=989e12,
        # same datasheet: 3.35 TB/s HBM3
        hbm_bw=3.35e12,
        # datasheet 80 GB; nvidia-smi reports 81559 MiB on H100 80GB HBM3
        hbm_bytes=81559 * MiB,
        # datasheet: PCIe Gen5 128 GB/s (both directions) -> 64 GB/s one way
        h2d_bw=64 * GB,
        # datasheet: NVLink 900 GB/s (both directions) -> 450 GB/s one way
        nvlink_bw=450 * GB,
        # DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU -> 50 GB/s
        network_bw=50 * GB,
    ),
    "H800": GPU(
        name="H800",
        # NVIDIA H800 SXM datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense (same die as H100)
        peak_flops=989e12,
        # same datasheet: 3.35 TB/s HBM3
        hbm_bw=3.35e12,
        # datasheet 80 GB, the HBM3 stacks of the H100 80GB (81559 MiB)
        hbm_bytes=81559 * MiB,
        # datasheet: PCIe Gen5 128 GB/s (both directions) -> 64 GB/s one way
        h2d_bw=64 * GB,
        # datasheet: NVLink 400 GB/s (both directions) -> 200 GB/s one way; the export-limited link
        nvlink_bw=200 * GB,
        # DeepSeek-V3 technical report (H800 cluster): InfiniBand 50 GB/s per GPU
        network_bw=50 * GB,
    ),
    "H200": GPU(
        name="H200",
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense
        peak_flops=989e12,
        # same datasheet: 4.8 TB/s HBM3e
        hbm_bw=4.8e12,
        # datasheet 141 GB; nvidia-smi reports 143771 MiB
        hbm_bytes=143771 * MiB,
        # datasheet: PCIe Gen5 128 GB/s (both directions) -> 64 GB/s one way
        h2d_bw=64 * GB,
        # datasheet: NVLink 900 GB/s (both directions) -> 450 GB/s one way
        nvlink_bw=450 * GB,
        # HGX/DGX H200 reference design: one 400 Gb/s ConnectX-7 per GPU -> 50 GB/s
        network_bw=50 * GB,
    ),
    "A100": GPU(
        name="A100",
        # NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): BF16 312 TFLOPS dense (624 with sparsity)
        peak_flops=312e12,
        # same datasheet: 2,039 GB/s HBM2e (80GB SXM)
        hbm_bw=2.039e12,
        # datasheet 80 GB; nvidia-smi reports 81920 MiB on A100-SXM4-80GB
        hbm_bytes=81920 * MiB,
        # datasheet: PCIe Gen4 64 GB/s (both directions) -> 32 GB/s one way
        h2d_bw=32 * GB,
        # datasheet: NVLink 600 GB/s (both directions) -> 300 GB/s one way
        nvlink_bw=300 * GB,
        # DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s
        network_bw=25 * GB,
    ),
}
