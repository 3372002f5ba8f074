"""`submit_writes` (caller-planned write batches) and per-imm arrival counts, two engines."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.harness import assert_rows_landed
from workers.fabric import FabricError, OutOfRangeError, TransferEngine, coalesce_page_runs
from workers.fabric.counters import ImmCounters

pytestmark = pytest.mark.timeout(120)


class Pair:
    """A sender's 64 KiB source (bytes 0..255 repeating) and a receiver's zeroed target."""

    def __init__(self, make_engine: Callable[..., TransferEngine]) -> None:
        self.sender, self.receiver = make_engine(), make_engine()
        self.source = np.arange(1 << 16, dtype=np.uint8)
        self.target = np.zeros(1 << 16, dtype=np.uint8)
        self.handle, _ = self.sender.register(self.source)
        _, self.descriptor = self.receiver.register(self.target)
        self.peer = self.sender.add_peer(self.receiver.address)


def test_submit_writes_posts_exactly_the_rows(make_engine: Callable[..., TransferEngine]) -> None:
    pair = Pair(make_engine)
    rows = np.array([[0, 4096, 100], [1000, 0, 300], [60000, 30000, 5536]], dtype=np.int64)
    landed, done = threading.Event(), threading.Event()
    pair.receiver.expect_imm(77, 3, landed.set)
    count = pair.sender.submit_writes(
        pair.handle, pair.peer, pair.descriptor, rows, imm=77, on_done=done.set
    )
    assert count == 3
    assert landed.wait(30) and done.wait(30)
    assert_rows_landed(pair.target, pair.source, rows)
    assert pair.receiver.imm_arrivals(77) == 0  # fired: the value is free again
    with pytest.raises(OutOfRangeError):
        pair.sender.submit_writes(
            pair.handle, pair.peer, pair.descriptor, np.array([[0, (1 << 16) - 10, 20]])
        )
    with pytest.raises(OutOfRangeError):
        pair.sender.submit_writes(pair.handle, pair.peer, pair.descriptor, np.array([[0, 0, 0]]))
    with pytest.raises(OutOfRangeError):
        pair.sender.submit_writes(pair.handle, pair.peer, pair.descriptor, np.array([0, 0, 8]))


def test_prepared_writes_post_in_row_ranges(make_engine: Callable[..., TransferEngine]) -> None:
    pair = Pair(make_engine)
    rows = np.array([[0, 0, 1000], [2000, 5000, 300], [4000, 9000, 50], [8000, 20000, 7]])
    prepared = pair.sender.prepare_writes(pair.handle, pair.peer, pair.descriptor, rows)
    assert len(prepared) == 4 and pair.sender.stats().progress.ops_posted == 0
    with pytest.raises(OutOfRangeError):
        pair.sender.submit_prepared(prepared, 2, 5)
    with pytest.raises(OutOfRangeError):
        pair.sender.submit_prepared(prepared, 1, 1)
    for start, stop, imm in ((1, 3, 41), (0, 1, 42), (3, 4, 43)):  # any order, disjoint
        landed, done = threading.Event(), threading.Event()
        pair.receiver.expect_imm(imm, stop - start, landed.set)
        pair.sender.submit_prepared(prepared, start, stop, imm=imm, on_done=done.set)
        # Both ends: the target's counter can fire before the sender's completion is reaped,
        # and the sender counts a write's bytes at its completion.
        assert landed.wait(30) and done.wait(30)
    assert_rows_landed(pair.target, pair.source, rows)
    assert pair.sender.stats().progress.ops_posted == 4
    assert pair.sender.stats().progress.bytes_written == int(rows[:, 2].sum())
    with pytest.raises(OutOfRangeError):  # checked when prepared: nothing is laid out
        pair.sender.prepare_writes(
            pair.handle, pair.peer, pair.descriptor, np.array([[0, (1 << 16) - 4, 8]])
        )
    pair.sender.deregister(pair.handle)
    with pytest.raises(FabricError):  # the region went away since: refused at submit
        pair.sender.submit_prepared(prepared, 0, 1)
    assert pair.sender.stats().progress.ops_posted == 4


def test_arrivals_are_counted_armed_buffered_and_after_cancel() -> None:
    counters = ImmCounters()
    counters.record({5: 2})
    assert counters.arrived(5) == 2  # buffered before arming
    counters.expect(5, 10, lambda: None)
    counters.record({5: 3})
    assert counters.arrived(5) == 5
    assert counters.cancel(5)
    counters.record({5: 4})  # late writes of the cancelled transfer
    assert counters.arrived(5) == 9 and counters.stats().late_dropped == 4
    counters.expect(5, 1, lambda: None)  # re-arming starts a new count
    assert counters.arrived(5) == 0


def test_segment_cuts_in_the_one_run_rule() -> None:
    pages = list(range(10))
    runs = coalesce_page_runs(pages, pages, segment_pages=4, first_page_index=2)
    assert runs.tolist() == [[0, 0, 2], [2, 2, 4], [6, 6, 4]]
    with pytest.raises(ValueError, match="segment_pages"):
        coalesce_page_runs(pages, pages, segment_pages=0)
