"""shm registrations (and tcp ones when asked) move host regions to transparent huge pages,
contents intact (registration.py).

The speed-up itself (CMA copies from huge pages) is measured in bench/history/RESULTS-notebook.md, not here.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest
import torch

from tests.fabric.harness import RemoteTarget, close_engine
from workers.fabric import FabricError, TransferEngine
from workers.fabric.registration import advise_huge_pages

MIB = 1 << 20
REGION = 8 * MIB
pytestmark = pytest.mark.timeout(90)


def _huge_page_bytes(address: int, length: int) -> int:
    """AnonHugePages of the mappings overlapping ``[address, address + length)``."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                overlaps = start < address + length and address < end
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _thp_available() -> bool:
    """Whether this kernel collapses a faulted-in torch buffer (MADV_COLLAPSE, THP not off)."""
    probe = torch.ones(4 * MIB, dtype=torch.uint8)
    return advise_huge_pages(probe.data_ptr(), probe.numel()) > 0


def _random_tensor(seed: int) -> tuple[torch.Tensor, mmap.mmap]:
    """Random bytes in a torch tensor over a mapping of its own (so `_huge_page_bytes` sees
    only it), faulted in on 4 KiB pages like torch's own large allocations."""
    mapping = mmap.mmap(-1, REGION, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=generator))
    return tensor, mapping


@pytest.mark.parametrize(("provider", "huge_pages"), [("shm", None), ("tcp;ofi_rxm", True)])
def test_register_collapses_a_torch_region_and_keeps_its_bytes(
    provider: str, huge_pages: bool | None
) -> None:
    tensor, _mapping = _random_tensor(3)
    expected = tensor.numpy().copy()
    interior = REGION - 2 * MIB  # at least this much of any 8 MiB span is 2 MiB-aligned
    engine = TransferEngine(provider, huge_pages=huge_pages)
    target = RemoteTarget(provider, REGION)
    try:
        handle, _ = engine.register(tensor)
        assert np.array_equal(tensor.numpy(), expected)
        if _thp_available():
            assert _huge_page_bytes(handle.address, handle.length) >= interior
        # The collapsed pages are the ones the write reads from: the bytes land exactly.
        peer = engine.add_peer(target.address)
        target.expect([5], 1)
        done, errors = threading.Event(), list[FabricError]()
        engine.submit_write(
            handle, 0, peer, target.descriptor, 0, REGION, imm=5,
            on_done=done.set, on_error=errors.append,
        )  # fmt: skip
        assert done.wait(30) and not errors, errors
        assert target.wait_for("reached")["imm"] == 5
        assert target.dump() == expected.tobytes()
    finally:
        assert target.close() == 0
        close_engine(engine)


@pytest.mark.parametrize(("provider", "huge_pages"), [("tcp;ofi_rxm", None), ("shm", False)])
def test_registration_leaves_pages_alone_when_not_asked(
    provider: str, huge_pages: bool | None
) -> None:
    tensor, _mapping = _random_tensor(4)
    expected = tensor.numpy().copy()
    engine = TransferEngine(provider, huge_pages=huge_pages)
    try:
        handle, _ = engine.register(tensor)
        assert _huge_page_bytes(handle.address, handle.length) == 0
        assert np.array_equal(tensor.numpy(), expected)
    finally:
        close_engine(engine)


def test_advise_skips_regions_without_an_aligned_huge_page() -> None:
    # 3 MiB starting 1 MiB past a 2 MiB boundary holds no whole huge page.
    buffer = torch.zeros(6 * MIB, dtype=torch.uint8)
    base = -(-buffer.data_ptr() // (2 * MIB)) * (2 * MIB)
    assert advise_huge_pages(base + MIB, 2 * MIB) == 0
