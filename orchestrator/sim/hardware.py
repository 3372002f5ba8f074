"""GPU and NIC presets for the roofline cost model, with the numbers' sources.

Peak FLOP/s are dense (no 2:4 sparsity) BF16 tensor-core figures: NVIDIA's datasheets quote
the sparse figure, twice these. Bandwidths are the datasheets' peaks; what a kernel reaches
is a separate, explicit efficiency factor in `roofline.Efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
MiB = 2**20


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float  # device memory as the driver reports it (nvidia-smi memory.total)
    nvlink_bandwidth: float  # bytes/s per GPU, one direction
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.hbm_bandwidth, self.hbm_bytes, self.nvlink_bandwidth) <= 0:
            raise ValueError(f"{self.name}: every rate and size must be positive")


@dataclass(frozen=True)
class NICSpec:
    name: str
    bandwidth: float  # bytes/s per NIC, one direction
    num_nics: int  # per node (typically one per GPU)
    latency: float  # seconds, one RDMA write's fixed cost

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.num_nics < 1 or self.latency < 0:
            raise ValueError(f"{self.name}: bad NIC spec")


GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS "with sparsity"
    # (989 dense), "80GB" HBM3 at 3.35 TB/s, NVLink 900 GB/s (bidirectional: 450 each way).
    # Memory: what the device reports, not the marketing figure. nvidia-smi on an
    # "NVIDIA H100 80GB HBM3" shows 81559MiB total (e.g. wilicc/gpu-burn#114, NVIDIA/nccl#1264;
    # modal-labs/modal-client#2797 lists it as 85.52 GB): 85.5e9 bytes, not 80e9.
    "h100": GPUSpec("H100 SXM", 989e12, 3.35e12, 81559 * MiB, 450 * GB),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM (BF16 1,979
    # TFLOPS with sparsity), "141GB" HBM3e at 4.8 TB/s, NVLink 900 GB/s. Memory as reported:
    # nvidia-smi on an "NVIDIA H200" shows 143771MiB total (public nvidia-smi logs of 8 x H200
    # nodes; NVIDIA/mig-parted#146/#89 add the 141GB part): 150.75e9 bytes, not 141e9.
    "h200": GPUSpec("H200 SXM", 989e12, 4.8e12, 143771 * MiB, 450 * GB),
}

NICS: dict[str, NICSpec] = {
    # ConnectX-7 / DGX H100-class nodes: 8 x 400 Gb/s (50 GB/s each), one NIC per GPU.
    # ~5 us is a typical small RDMA write's completion latency over one switch.
    "8x400g": NICSpec("8x400Gb/s", 50 * GB, 8, 5e-6),
    # AWS p5 (H100): EFA 3,200 Gb/s in total, as 32 x 100 Gb/s; EFA writes cost more.
    "efa-3200g": NICSpec("EFA 32x100Gb/s", 12.5 * GB, 32, 15e-6),
    # Commodity: one 100 Gb/s NIC per node.
    "1x100g": NICSpec("1x100Gb/s", 12.5 * GB, 1, 10e-6),
}
