"""GPU variant of the shared KV pools (design in ``shared_kv``; not implemented, not tested).

Imported lazily, only when a TP group runs on CUDA, so CPU installs never need ``cuda-python``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaPoolHandle:
    """A rank's exported pool: a POSIX file descriptor from ``cuMemExportToShareableHandle``,
    valid only in the exporting process until sent to the leader with ``SCM_RIGHTS``."""

    fd: int
    nbytes: int
    device_index: int


def create_cuda_pool_handle(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, CudaPoolHandle]:
    """Follower: ``cuMemCreate`` + ``cuMemMap`` the pool on ``device`` and export a handle."""
    raise NotImplementedError("CUDA shared KV pools (cuMem export/import) are not implemented yet")


def open_cuda_pool_handle(
    handle: CudaPoolHandle, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Leader: ``cuMemImportFromShareableHandle`` + map, giving a tensor over the rank's pool."""
    raise NotImplementedError("CUDA shared KV pools (cuMem export/import) are not implemented yet")
