"""Where an engine runs: the ``device`` option, parsed and checked before anything is allocated.

``cpu`` (the default), ``cuda`` (the current CUDA device), ``cuda:N``, or ``auto`` (``cuda`` when
torch sees a GPU, else ``cpu``). A CUDA device that torch cannot use is a `DeviceError` raised
before the checkpoint is read, so a misconfigured worker fails at once with the reason, not
later inside a kernel.

What runs where on CUDA: weights, the KV pool and every step tensor live on the device; the
attention backend is FlashInfer for half-precision caches when ``flashinfer`` is installed, else
the torch backend's gather path; layer progress is published by stream-ordered copies
(`workers.engine.layer_progress_cuda`). Under tensor parallelism rank ``r`` runs on the
``r``-th device after this one (`workers.engine.parallel.rank_devices`; NCCL all-reduces when
each rank has its own GPU), and the followers' pools are cuMem allocations the leader maps
(`workers.engine.shared_kv_cuda`); decode steps then run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from workers.engine.errors import EngineError

if TYPE_CHECKING:  # torch is imported when a device is resolved: configs parse without it
    import torch

_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


class DeviceError(EngineError, ValueError):
    """A ``device`` the engine cannot run on here (malformed, or no such CUDA device)."""


def check_device_name(name: str) -> None:
    """The spelling alone (no hardware query): for config validation on any host."""
    if not isinstance(name, str) or not _DEVICE.match(name):
        raise DeviceError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` means on this host; `DeviceError` if it cannot be used."""
    import torch

    check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {name!r}: torch sees no CUDA device here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}); use device cpu"
        )
    device = torch.device(name)
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r}: this host has {count} CUDA device(s)")
    return torch.device("cuda", index)
