"""GPU variant of the shared KV pools (design in ``shared_kv``): cuMem export and import.

A TP rank allocates its pool with the CUDA driver's virtual memory API so that another process
(the group's leader, whose single transfer engine registers every rank's pool) can map the same
device memory:

    owner:  cuMemCreate (POSIX fd handle, GPUDirect RDMA capable where the device supports it)
            -> cuMemAddressReserve -> cuMemMap -> cuMemSetAccess -> cuMemExportToShareableHandle
    ------- the fd travels over a Unix socket with SCM_RIGHTS (`send_pool_handle`): a file
            descriptor means nothing outside its process, and no other channel can carry it
    leader: cuMemImportFromShareableHandle -> cuMemAddressReserve -> cuMemMap -> cuMemSetAccess

Both sides wrap the mapping as a torch tensor through ``__cuda_array_interface__`` (no copy;
the tensor does not own the memory: `CudaPool.close` unmaps and releases it, after the transfer
engine deregistered it). The device travels as its PCI bus id, since ``CUDA_VISIBLE_DEVICES``
may number it differently in the two processes.

The driver is reached through ``ctypes`` (``libcuda.so.1``), so CPU installs need nothing and
this module is imported only when a pool lives on CUDA. Not exercised on CPU; the GPU tests
(``tests/engine/test_shared_kv_cuda.py``, marker ``gpu``) run an owner and an importer
process on one device.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.errors import TensorParallelError
from workers.engine.shared_kv import pool_nbytes

_HANDLE_TYPE_POSIX_FD = 0x1
_ALLOCATION_PINNED = 0x1
_LOCATION_DEVICE = 0x1
_ACCESS_READWRITE = 0x3
_GRANULARITY_RECOMMENDED = 0x1
_ATTR_VMM_SUPPORTED = 102
_ATTR_POSIX_FD_SUPPORTED = 103
_ATTR_RDMA_WITH_VMM = 110


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaPoolError(TensorParallelError):
    """A CUDA driver call for a shared KV pool failed (message names the call and the error)."""


_driver: Any = None


def _cuda() -> Any:
    global _driver
    if _driver is None:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise CudaPoolError(f"CUDA driver library not found: {error}") from error
        _check(driver, driver.cuInit(0), "cuInit")
        _driver = driver
    return _driver


def _check(driver: Any, rc: int, call: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(rc, ctypes.byref(text))
        reason = text.value.decode() if text.value else "unknown error"
        raise CudaPoolError(f"{call} failed: {reason} ({rc})")


def _device_of(pci_bus_id: str) -> int:
    driver = _cuda()
    device = ctypes.c_int()
    _check(
        driver,
        driver.cuDeviceGetByPCIBusId(ctypes.byref(device), pci_bus_id.encode()),
        f"cuDeviceGetByPCIBusId({pci_bus_id})",
    )
    return device.value


def _pci_bus_id(device: int) -> str:
    driver = _cuda()
    buffer = ctypes.create_string_buffer(32)
    _check(driver, driver.cuDeviceGetPCIBusId(buffer, 32, device), "cuDeviceGetPCIBusId")
    return buffer.value.decode()


def _attribute(device: int, attribute: int) -> int:
    driver = _cuda()
    value = ctypes.c_int()
    _check(
        driver,
        driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
        "cuDeviceGetAttribute",
    )
    return value.value


@dataclass(frozen=True)
class CudaPoolHandle:
    """A rank's exported pool: a POSIX file descriptor from ``cuMemExportToShareableHandle``,
    valid only in the process that holds it (sent to the leader with `send_pool_handle`);
    ``size``: the mapped bytes (``nbytes`` rounded up to the allocation granularity)."""

    fd: int
    nbytes: int
    size: int
    pci_bus_id: str


class _ArrayInterface:
    """A bare ``__cuda_array_interface__`` over ``nbytes`` bytes at ``address``."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class CudaPool:
    """One mapping of a cuMem allocation in this process and the tensor over it."""

    def __init__(
        self,
        allocation: int,
        size: int,
        device: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        nbytes: int,
    ) -> None:
        driver = _cuda()
        self._allocation = allocation
        self._size = size
        self._address = ctypes.c_uint64()
        self._mapped = False
        try:
            _check(
                driver,
                driver.cuMemAddressReserve(
                    ctypes.byref(self._address),
                    ctypes.c_size_t(size),
                    ctypes.c_size_t(0),
                    ctypes.c_uint64(0),
                    ctypes.c_uint64(0),
                ),
                "cuMemAddressReserve",
            )
            _check(
                driver,
                driver.cuMemMap(
                    self._address,
                    ctypes.c_size_t(size),
                    ctypes.c_size_t(0),
                    ctypes.c_uint64(allocation),
                    ctypes.c_uint64(0),
                ),
                "cuMemMap",
            )
            self._mapped = True
            access = _AccessDesc(_Location(_LOCATION_DEVICE, device), _ACCESS_READWRITE)
            _check(
                driver,
                driver.cuMemSetAccess(
                    self._address, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)
                ),
                "cuMemSetAccess",
            )
        except BaseException:
            self.close()
            raise
        raw = torch.as_tensor(_ArrayInterface(self._address.value, nbytes), device=f"cuda:{device}")
        self.tensor = raw.view(dtype).view(shape)

    def close(self) -> None:
        """Unmap and release; the tensor must not be used afterwards."""
        driver = _cuda()
        if self._mapped:
            driver.cuMemUnmap(self._address, ctypes.c_size_t(self._size))
            self._mapped = False
        if self._address.value:
            driver.cuMemAddressFree(self._address, ctypes.c_size_t(self._size))
            self._address = ctypes.c_uint64()
        if self._allocation:
            driver.cuMemRelease(ctypes.c_uint64(self._allocation))
            self._allocation = 0


def create_cuda_pool_handle(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[CudaPool, CudaPoolHandle]:
    """Owner: allocate the pool on ``device`` (zeroed), map it here and export a handle."""
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    # The driver calls run with the device's primary context current (and the caller's
    # current device restored after).
    with torch.cuda.device(index):
        return _create(shape, dtype, index)


def _create(
    shape: tuple[int, ...], dtype: torch.dtype, index: int
) -> tuple[CudaPool, CudaPoolHandle]:
    torch.cuda.synchronize(index)
    driver = _cuda()
    if not _attribute(index, _ATTR_VMM_SUPPORTED) or not _attribute(
        index, _ATTR_POSIX_FD_SUPPORTED
    ):
        raise CudaPoolError(f"cuda:{index} cannot export memory as a POSIX fd (cuMem VMM)")
    nbytes = pool_nbytes(shape, dtype)
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.requestedHandleTypes = _HANDLE_TYPE_POSIX_FD
    prop.location = _Location(_LOCATION_DEVICE, index)
    # The NIC must be able to register the pool (the leader's transfer engine does).
    prop.allocFlags.gpuDirectRDMACapable = 1 if _attribute(index, _ATTR_RDMA_WITH_VMM) else 0
    granularity = ctypes.c_size_t()
    _check(
        driver,
        driver.cuMemGetAllocationGranularity(
            ctypes.byref(granularity), ctypes.byref(prop), _GRANULARITY_RECOMMENDED
        ),
        "cuMemGetAllocationGranularity",
    )
    size = -(-nbytes // granularity.value) * granularity.value
    allocation = ctypes.c_uint64()
    _check(
        driver,
        driver.cuMemCreate(
            ctypes.byref(allocation), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)
        ),
        f"cuMemCreate({size} bytes on cuda:{index})",
    )
    pool = CudaPool(allocation.value, size, index, shape, dtype, nbytes)
    try:
        fd = ctypes.c_int(-1)
        _check(
            driver,
            driver.cuMemExportToShareableHandle(
                ctypes.byref(fd),
                ctypes.c_uint64(allocation.value),
                _HANDLE_TYPE_POSIX_FD,
                ctypes.c_uint64(0),
            ),
            "cuMemExportToShareableHandle",
        )
        pool.tensor.zero_()
        torch.cuda.synchronize(index)
    except BaseException:
        if fd.value >= 0:
            os.close(fd.value)
        pool.close()
        raise
    return pool, CudaPoolHandle(fd.value, nbytes, size, _pci_bus_id(index))


def open_cuda_pool_handle(
    handle: CudaPoolHandle, shape: tuple[int, ...], dtype: torch.dtype
) -> CudaPool:
    """Leader: import the owner's allocation and map it here, on the owner's device (found by
    its PCI bus id). Closes ``handle.fd`` (the import holds its own reference)."""
    torch.cuda.init()
    driver = _cuda()
    try:
        device = _device_of(handle.pci_bus_id)
        with torch.cuda.device(device):
            # torch creates a device's primary context lazily; the driver calls below need it
            # current (the owner's `_create` does the same).
            torch.cuda.synchronize(device)
            allocation = ctypes.c_uint64()
            _check(
                driver,
                driver.cuMemImportFromShareableHandle(
                    ctypes.byref(allocation), ctypes.c_void_p(handle.fd), _HANDLE_TYPE_POSIX_FD
                ),
                "cuMemImportFromShareableHandle",
            )
            return CudaPool(allocation.value, handle.size, device, shape, dtype, handle.nbytes)
    finally:
        os.close(handle.fd)


def send_pool_handle(sock: socket.socket, handle: CudaPoolHandle) -> None:
    """Send ``handle`` over a connected Unix socket: its fields as JSON, the fd as SCM_RIGHTS
    (the receiver gets its own descriptor; the sender closes ``handle.fd`` when done)."""
    fields = {"nbytes": handle.nbytes, "size": handle.size, "pci_bus_id": handle.pci_bus_id}
    socket.send_fds(sock, [json.dumps(fields).encode()], [handle.fd])


def recv_pool_handle(sock: socket.socket) -> CudaPoolHandle:
    """Receive one `send_pool_handle`; the fd is a new descriptor in this process."""
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    if len(fds) != 1 or not data:
        for fd in fds:
            os.close(fd)
        raise CudaPoolError("pool handle message without exactly one file descriptor")
    try:
        fields = json.loads(data)
        return CudaPoolHandle(
            fds[0], int(fields["nbytes"]), int(fields["size"]), str(fields["pci_bus_id"])
        )
    except (ValueError, KeyError, TypeError) as error:
        os.close(fds[0])
        raise CudaPoolError(f"malformed pool handle message: {error}") from error


class PoolExchange:
    """The leader's end of a TP group's handle exchange: one listening Unix socket per
    follower rank, in a private temporary directory (removed by `close`)."""

    def __init__(self, ranks: range) -> None:
        self.directory = tempfile.mkdtemp(prefix="pdserve-kv-")
        self._listeners: dict[int, socket.socket] = {}
        try:
            for rank in ranks:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners[rank] = listener
                listener.bind(self.path(rank))
                listener.listen(1)
        except BaseException:
            self.close()
            raise

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank{rank}.sock")

    def receive(self, rank: int, timeout_s: float) -> CudaPoolHandle:
        """Rank ``rank``'s handle (it connected and sent it before reporting ready)."""
        listener = self._listeners[rank]
        listener.settimeout(timeout_s)
        try:
            connection, _ = listener.accept()
        except TimeoutError as error:
            raise CudaPoolError(f"TP rank {rank} sent no KV pool handle") from error
        with connection:
            connection.settimeout(timeout_s)
            return recv_pool_handle(connection)

    def close(self) -> None:
        for listener in self._listeners.values():
            listener.close()
        self._listeners.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def offer_pool(path: str, handle: CudaPoolHandle) -> None:
    """Follower: send ``handle`` to the leader's `PoolExchange` socket at ``path``, then close
    this process's descriptor (the leader's import holds its own reference)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            send_pool_handle(sock, handle)
    finally:
        os.close(handle.fd)
