"""Device memory (FI_HMEM): engines opened with ``hmem=True`` and what `register` accepts.

On this CPU machine shm offers FI_HMEM (libfabric 1.17), so an hmem engine and its
`fi_mr_regattr` registration path run for real here on host memory; tcp has no FI_HMEM and
must say so at open. Registering CUDA memory needs a GPU (tests marked ``gpu``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.fabric.harness import assert_rows_landed, close_engine
from workers.fabric import FabricUnavailableError, RegistrationError, TransferEngine
from workers.fabric.handles import buffer_extent

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def shm_hmem_pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    sender, receiver = TransferEngine("shm", hmem=True), TransferEngine("shm", hmem=True)
    yield sender, receiver
    close_engine(sender)
    close_engine(receiver)


def test_hmem_engine_moves_host_pages_bit_exact(
    shm_hmem_pair: tuple[TransferEngine, TransferEngine],
) -> None:
    torch = pytest.importorskip("torch")
    sender, receiver = shm_hmem_pair
    assert sender.hmem and receiver.hmem
    source = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8)
    target = np.zeros(1 << 18, dtype=np.uint8)
    handle, _ = sender.register(source)
    _, descriptor = receiver.register(target)
    peer = sender.add_peer(receiver.address)
    rows = np.array([[0, 8192, 65536], [100_000, 0, 4096], [200_000, 150_000, 62144]])
    landed, done = threading.Event(), threading.Event()
    receiver.expect_imm(9, len(rows), landed.set)
    sender.submit_writes(handle, peer, descriptor, rows, imm=9, on_done=done.set)
    assert landed.wait(30) and done.wait(30)
    assert_rows_landed(target, source.numpy(), rows)


def test_provider_without_hmem_fails_at_open() -> None:
    with pytest.raises(FabricUnavailableError, match="FI_HMEM"):
        TransferEngine("tcp;ofi_rxm", hmem=True)
    engine = TransferEngine("tcp;ofi_rxm")
    try:
        assert not engine.hmem
    finally:
        close_engine(engine)


def test_only_cpu_and_cuda_tensors_register() -> None:
    torch = pytest.importorskip("torch")
    extent = buffer_extent(torch.zeros(8))
    assert extent.cuda_device == -1 and extent.length == 32
    assert buffer_extent(bytearray(5)).cuda_device == -1
    with pytest.raises(RegistrationError, match="meta"):
        buffer_extent(torch.empty(8, device="meta"))


def _need_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_cuda_tensor_needs_an_hmem_engine() -> None:
    _need_cuda()
    import torch

    engine = TransferEngine("shm")
    try:
        with pytest.raises(RegistrationError, match="hmem=True"):
            engine.register(torch.zeros(1024, device="cuda"))
        assert buffer_extent(torch.zeros(4, device="cuda")).cuda_device == 0
    finally:
        close_engine(engine)


@pytest.mark.gpu
def test_gpu_pages_arrive_bit_exact_over_shm() -> None:
    """GPU to GPU through a libfabric shm built with CUDA (CUDA IPC); a libfabric without
    CUDA support refuses the registration with a typed error, and the test says so."""
    _need_cuda()
    import torch

    sender, receiver = TransferEngine("shm", hmem=True), TransferEngine("shm", hmem=True)
    try:
        source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        target = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            handle, _ = sender.register(source)
            _, descriptor = receiver.register(target)
        except RegistrationError as error:
            pytest.skip(f"this libfabric cannot register CUDA memory: {error}")
        peer = sender.add_peer(receiver.address)
        rows = np.array([[0, 4096, 1 << 19], [1 << 19, (1 << 19) + 8192, 65536]])
        landed = threading.Event()
        receiver.expect_imm(3, len(rows), landed.set)
        sender.submit_writes(handle, peer, descriptor, rows, imm=3)
        assert landed.wait(30)
        torch.cuda.synchronize()
        for s, d, n in rows.tolist():
            assert torch.equal(target[d : d + n], source[s : s + n])
    finally:
        close_engine(sender)
        close_engine(receiver)
