"""cuMem-shared KV pools (`workers.engine.shared_kv_cuda`).

The handle's trip between processes (JSON fields + the fd as SCM_RIGHTS) runs on any Linux
host; the CUDA part needs a GPU (marker ``gpu``): an owner process allocates and exports a
pool on cuda:0, this process imports and maps it, and each sees the other's writes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest
import torch

from workers.engine.shared_kv_cuda import (
    CudaPoolError,
    CudaPoolHandle,
    recv_pool_handle,
    send_pool_handle,
)

pytestmark = pytest.mark.timeout(120)
SHAPE = (2, 8, 2, 2, 16, 32)  # [L, N, 2, H, P, D]


def test_handle_travels_with_its_fd() -> None:
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("pool")
    try:
        os.write(fd, b"kv bytes")
        send_pool_handle(sender, CudaPoolHandle(fd, 4000, 2 << 20, "0000:3b:00.0"))
        got = recv_pool_handle(receiver)
        try:
            assert (got.nbytes, got.size, got.pci_bus_id) == (4000, 2 << 20, "0000:3b:00.0")
            assert got.fd != fd
            assert os.pread(got.fd, 8, 0) == b"kv bytes"  # the same file, a new descriptor
        finally:
            os.close(got.fd)
        sender.send(b"no descriptor")
        with pytest.raises(CudaPoolError, match="exactly one file descriptor"):
            recv_pool_handle(receiver)
        socket.send_fds(sender, [b"not json"], [fd])
        with pytest.raises(CudaPoolError, match="malformed"):
            recv_pool_handle(receiver)
    finally:
        os.close(fd)
        sender.close()
        receiver.close()


def _owner(path: str) -> None:
    """Spawned: export a pool holding 0..n-1, then check the importer's write (exit code)."""
    from workers.engine.shared_kv_cuda import create_cuda_pool_handle

    pool, handle = create_cuda_pool_handle(SHAPE, torch.float32, torch.device("cuda", 0))
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view(SHAPE))
    torch.cuda.synchronize()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        send_pool_handle(sock, handle)
        os.close(handle.fd)
        assert sock.recv(2) == b"ok"  # the importer wrote -1 into page 3 of every layer
        torch.cuda.synchronize()
        ok = bool((pool.tensor[:, 3] == -1).all()) and bool(pool.tensor[:, 4].ne(-1).all())
        sock.sendall(b"y" if ok else b"n")
    pool.close()


@pytest.mark.gpu
def test_pool_is_shared_between_processes(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workers.engine.shared_kv_cuda import open_cuda_pool_handle

    path = str(tmp_path / "pool.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        owner = mp.get_context("spawn").Process(target=_owner, args=(path,))
        owner.start()
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            pool = open_cuda_pool_handle(recv_pool_handle(conn), SHAPE, torch.float32)
            try:
                expected = torch.arange(pool.tensor.numel(), dtype=torch.float32).view(SHAPE)
                assert torch.equal(pool.tensor.cpu(), expected)
                pool.tensor[:, 3] = -1
                torch.cuda.synchronize()
                conn.sendall(b"ok")
                assert conn.recv(1) == b"y"
            finally:
                pool.close()
        owner.join(60)
    assert owner.exitcode == 0
