"""Bytes written across processes arrive bit-exact; bad writes are refused before posting."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from workers.fabric import (
    DescriptorError,
    MemoryRegionDescriptor,
    OutOfRangeError,
    RegistrationError,
    TransferEngine,
    count_paged_write_runs,
)

PAGE = 4096
SRC_PAGES = 64
DST_PAGES = 128
pytestmark = pytest.mark.timeout(90)


def _wait(event: threading.Event, errors: list[BaseException]) -> None:
    assert event.wait(30), "no completion"
    assert not errors, errors


def test_pages_arrive_bit_exact(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    rng = np.random.default_rng(7)
    target = make_target(DST_PAGES * PAGE)
    engine = make_engine()
    src = rng.integers(0, 256, SRC_PAGES * PAGE, dtype=np.uint8)
    handle, _ = engine.register(src)
    peer = engine.add_peer(target.address)
    expected = np.zeros(DST_PAGES * PAGE, dtype=np.uint8)

    # (src pages, dst pages, number of writes): gaps, coalescable runs, region boundaries.
    cases = [
        ([0, 2, 4, 7], [10, 3, 50, 51], 4),
        ([8, 9, 10, 11, 12, 13, 14, 15, 20, 21], [20, 21, 22, 23, 24, 25, 26, 27, 40, 41], 2),
        ([63], [127], 1),  # last page of both regions
        ([0, 1, 2], [0, 1, 2], 1),  # first pages of the destination
        (list(range(30, 40)), list(range(100, 110)), 1),
    ]
    total_ops = sum(ops for _, _, ops in cases)
    target.expect([11], total_ops)
    for src_pages, dst_pages, ops in cases:
        assert count_paged_write_runs(src_pages, dst_pages) == ops
        done, errors = threading.Event(), []
        posted = engine.submit_paged_writes(
            handle, src_pages, peer, target.descriptor, dst_pages, PAGE,
            imm=11, on_done=done.set, on_error=errors.append,
        )  # fmt: skip
        assert posted == ops
        _wait(done, errors)
        for s, d in zip(src_pages, dst_pages, strict=True):
            expected[d * PAGE : (d + 1) * PAGE] = src[s * PAGE : (s + 1) * PAGE]
    assert target.wait_for("reached")["imm"] == 11
    landed = np.frombuffer(target.dump(), dtype=np.uint8)
    assert np.array_equal(landed, expected)


def test_strided_subpage_and_whole_region_writes(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    rng = np.random.default_rng(8)
    target = make_target(DST_PAGES * PAGE)
    engine = make_engine()
    src = rng.integers(0, 256, DST_PAGES * PAGE, dtype=np.uint8)
    handle, _ = engine.register(src)
    peer = engine.add_peer(target.address)

    target.expect([21], 1)
    done, errors = threading.Event(), []
    engine.submit_write(handle, 0, peer, target.descriptor, 0, src.nbytes, imm=21,
                        on_done=done.set, on_error=errors.append)  # fmt: skip
    _wait(done, errors)
    target.wait_for("reached")
    expected = src.copy()

    # A head-shard of a page: 1 KiB at byte 512 of each 4 KiB page; never coalesced.
    src_pages, dst_pages = [1, 2, 3], [5, 6, 7]
    target.expect([22], 3)
    done = threading.Event()
    posted = engine.submit_paged_writes(
        handle, src_pages, peer, target.descriptor, dst_pages, 1024,
        src_stride=PAGE, dst_stride=PAGE, src_offset=0, dst_offset=512,
        imm=22, on_done=done.set, on_error=errors.append,
    )  # fmt: skip
    assert posted == 3 == count_paged_write_runs(src_pages, dst_pages, coalesce=False)
    _wait(done, errors)
    target.wait_for("reached")
    for s, d in zip(src_pages, dst_pages, strict=True):
        expected[d * PAGE + 512 : d * PAGE + 1536] = src[s * PAGE : s * PAGE + 1024]
    assert np.array_equal(np.frombuffer(target.dump(), dtype=np.uint8), expected)


def test_out_of_range_writes_are_refused(make_engine: Callable[..., TransferEngine]) -> None:
    engine = make_engine()
    target = make_engine()
    src = np.zeros(4 * PAGE, dtype=np.uint8)
    handle, _ = engine.register(src)
    _, descriptor = target.register(np.zeros(8 * PAGE, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    refused = [
        lambda: engine.submit_write(handle, 0, peer, descriptor, 8 * PAGE - 10, 11),
        lambda: engine.submit_write(handle, 4 * PAGE - 10, peer, descriptor, 0, 11),
        lambda: engine.submit_write(handle, -1, peer, descriptor, 0, 10),
        lambda: engine.submit_write(handle, 0, peer, descriptor, 0, 0),
        lambda: engine.submit_paged_writes(handle, [0], peer, descriptor, [8], PAGE),
        lambda: engine.submit_paged_writes(handle, [4], peer, descriptor, [0], PAGE),
        lambda: engine.submit_paged_writes(handle, [0], peer, descriptor, [7], PAGE, dst_offset=1),
    ]
    for submit in refused:
        with pytest.raises(OutOfRangeError):
            submit()
    other = MemoryRegionDescriptor("verbs;ofi_rxm", 0, 8 * PAGE, 1, False)
    if engine.provider != "verbs;ofi_rxm":
        with pytest.raises(DescriptorError):
            engine.submit_write(handle, 0, peer, other, 0, 10)
    assert engine.stats().progress.ops_posted == 0


def test_rows_whose_int64_end_wraps_are_refused(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Range checks never form an int64 sum that could wrap (2**62 + 2**62 < 0) and so pass
    a write outside the region; writes that end exactly at the end still go."""
    target = make_engine()
    engine = make_engine()
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    huge = 1 << 62  # 2**62 + 2**62 wraps to -2**63 in int64
    for row in ([huge, 0, huge], [0, huge, huge], [huge, huge, huge], [-1, 0, 16], [0, -16, 16],
                [4096 - 16, 0, 17], [0, (1 << 63) - 1, 1]):  # fmt: skip
        ops = np.array([row], dtype=np.int64)
        with pytest.raises(OutOfRangeError):
            engine.prepare_writes(handle, peer, descriptor, ops)
        with pytest.raises(OutOfRangeError):
            engine.submit_writes(handle, peer, descriptor, ops)
    for kwargs in ({"src_stride": huge}, {"dst_stride": huge}, {"dst_offset": huge * 2 - 1},
                   {"src_offset": -(1 << 64)}):  # fmt: skip
        with pytest.raises(OutOfRangeError):
            engine.submit_paged_writes(handle, [0, 2], peer, descriptor, [0, 2], 16, **kwargs)
    # The edges still pass: a write that ends exactly at the end of both regions.
    done = threading.Event()
    ops = np.array([[4096 - 16, 4096 - 16, 16]], dtype=np.int64)
    engine.submit_writes(handle, peer, descriptor, ops, on_done=done.set)
    assert done.wait(30)


def test_register_accepts_host_buffers(make_engine: Callable[..., TransferEngine]) -> None:
    torch = pytest.importorskip("torch")
    engine = make_engine()
    tensor = torch.zeros(1024, dtype=torch.float16)
    handle, descriptor = engine.register(tensor)
    assert handle.length == descriptor.length == 2048
    pinned = bytearray(100)
    assert engine.register(pinned)[1].length == 100
    with pytest.raises(BufferError):  # registered: it must not move while peers write into it
        pinned.extend(b"x")
    assert engine.register(memoryview(bytearray(64)))[1].length == 64
    with pytest.raises(RegistrationError):
        engine.register(bytes(10))  # read-only
    with pytest.raises(RegistrationError):
        engine.register(np.zeros((4, 4))[:, 1])  # not contiguous
    with pytest.raises(RegistrationError):
        engine.register(torch.zeros(4, 4).t())
