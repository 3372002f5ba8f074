"""Local resources (`*Handle`): valid only inside the engine that created them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.fabric._lib import ffi
from workers.fabric.errors import RegistrationError

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import CData, FidMr


@dataclass(frozen=True)
class PeerHandle:
    """A peer inserted in this engine's address vector."""

    address: bytes
    fi_addr: int
    name: str

    def __repr__(self) -> str:
        return f"PeerHandle({self.name})"


@dataclass(frozen=True, eq=False)
class MemoryRegionHandle:
    """A region registered with this engine's domain; keeps the registered object alive."""

    address: int
    length: int
    key: int
    engine_id: int
    mr: FidMr = field(repr=False)
    desc: CData = field(repr=False)  # fi_mr_desc: passed with every local buffer
    owner: object = field(repr=False)


@dataclass(frozen=True)
class BufferExtent:
    """Where a buffer's bytes are: ``cuda_device`` is -1 for host memory, else the CUDA
    device whose memory they are (registered with FI_HMEM_CUDA)."""

    address: int
    length: int
    keep_alive: object
    cuda_device: int = -1


def buffer_extent(obj: object) -> BufferExtent:
    """The extent of a writable, contiguous buffer.

    Accepts torch CPU and CUDA tensors, numpy arrays, bytearray, writable memoryviews and
    anything else exporting a writable contiguous buffer.
    """
    torch_tensor = _torch_extent(obj)
    if torch_tensor is not None:
        return torch_tensor
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            raise RegistrationError("numpy array must be C-contiguous and writable")
        if obj.nbytes == 0:
            raise RegistrationError("cannot register an empty array")
        return BufferExtent(int(obj.ctypes.data), int(obj.nbytes), obj)
    try:
        cdata = ffi.from_buffer(obj, require_writable=True)
    except (TypeError, BufferError, ValueError) as exc:
        raise RegistrationError(
            f"cannot register {type(obj).__name__}: need a writable contiguous buffer "
            "(torch CPU or CUDA tensor, numpy array, bytearray, memoryview)"
        ) from exc
    if len(cdata) == 0:
        raise RegistrationError("cannot register an empty buffer")
    if isinstance(obj, memoryview) and not obj.contiguous:
        raise RegistrationError("memoryview must be contiguous")
    return BufferExtent(int(ffi.cast("uintptr_t", cdata)), len(cdata), (obj, cdata))


def _torch_extent(obj: object) -> BufferExtent | None:
    torch = _torch_module(obj)
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.device.type not in ("cpu", "cuda"):
        raise RegistrationError(f"cannot register a tensor on {obj.device} (cpu or cuda only)")
    if not obj.is_contiguous():
        raise RegistrationError("tensor must be contiguous")
    nbytes = obj.numel() * obj.element_size()
    if nbytes == 0:
        raise RegistrationError("cannot register an empty tensor")
    device = -1 if obj.device.type == "cpu" else int(obj.device.index or 0)
    return BufferExtent(int(obj.data_ptr()), int(nbytes), obj, device)


def _torch_module(obj: object) -> Any:
    # Import torch only when given something from it: the data plane must not pay torch's
    # import time in processes that never see a tensor.
    if type(obj).__module__.split(".")[0] != "torch":
        return None
    import torch

    return torch
