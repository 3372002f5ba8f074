"""The push thread over a real tcp fabric: woken by the layer counter, several layers per call.

Two in-process `TransferEngine`s on loopback `tcp;ofi_rxm` (the messengers' fabric); the forward
pass is a `LayerProgress` driven by hand, so which layers are done when is exact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.waiting import wait_until
from workers.engine.layer_progress import LayerProgress
from workers.fabric import FabricError, TransferEngine
from workers.kv.push import PassPlan, PushItem, PushThread, RankOps

LAYERS = 4
PAGE = 256  # bytes per page
PAGES = 8  # per layer of each pool
WAIT_S = 30.0


class Counting(LayerProgress):
    """Publishes elsewhere (like the CUDA counter): readers must poll."""

    def mark_layer_done(self, layer: int) -> None:
        super().mark_layer_done(layer)


def test_listeners_are_called_on_every_update_until_removed() -> None:
    progress = LayerProgress(LAYERS)
    calls: list[tuple[int, int]] = []

    def listener() -> None:
        calls.append(progress.read())

    progress.add_listener(listener)
    progress.begin_pass()
    progress.mark_layer_done(0)
    progress.remove_listener(listener)
    progress.mark_layer_done(1)
    assert calls == [(1, 0), (1, 1)]
    assert progress.notifies
    assert not Counting(LAYERS).notifies


@pytest.fixture
def fabric() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    source, target = TransferEngine("tcp;ofi_rxm"), TransferEngine("tcp;ofi_rxm")
    try:
        yield source, target
    finally:
        source.close()
        target.close()


def _run_pass(
    fabric: tuple[TransferEngine, TransferEngine], layerwise: bool, progress: LayerProgress
) -> tuple[PushThread, list[int], np.ndarray, np.ndarray, threading.Event]:
    """One pass of one item (pages 1, 2 and 5 -> 0, 1 and 6: two runs per layer)."""
    source, target = fabric
    src = np.random.default_rng(0).integers(0, 256, LAYERS * PAGES * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    handle, _ = source.register(src)
    _, descriptor = target.register(dst)
    peer = source.add_peer(target.address)
    rows = np.array([[1 * PAGE, 0, 2 * PAGE], [5 * PAGE, 6 * PAGE, PAGE]], dtype=np.int64)
    layer_bytes = PAGES * PAGE
    item = PushItem(
        "r", 7, peer, (descriptor,), (RankOps(0, 0, rows),), layer_bytes, layer_bytes, 2, 3 * PAGE
    )
    reached = threading.Event()
    target.expect_imm(7, 2 * LAYERS, reached.set)
    gated: list[int] = []

    def gate(gated_item: PushItem, layer: int) -> bool:
        gated.append(layer)
        return True

    def failed(request_id: str, count: int, error: FabricError) -> None:
        raise AssertionError(f"write failed: {error}")

    push = PushThread(
        source,
        [handle],
        progress,
        LAYERS,
        gate,
        lambda request_id, count: None,
        failed,
        layerwise=layerwise,
    )
    push.submit_pass(PassPlan(1, [item]))
    return push, gated, src, dst, reached


def _expected(src: np.ndarray) -> np.ndarray:
    expected = np.zeros_like(src)
    for layer in range(LAYERS):
        base = layer * PAGES * PAGE
        expected[base : base + 2 * PAGE] = src[base + PAGE : base + 3 * PAGE]
        expected[base + 6 * PAGE : base + 7 * PAGE] = src[base + 5 * PAGE : base + 6 * PAGE]
    return expected


def test_pass_end_sends_every_layer_in_one_call(
    fabric: tuple[TransferEngine, TransferEngine],
) -> None:
    progress = LayerProgress(LAYERS)
    push, gated, src, dst, reached = _run_pass(fabric, False, progress)
    try:
        # The push thread holds the plan (white-box: otherwise it, not pass_ended, sends).
        wait_until(
            lambda: push._current is not None,
            timeout=WAIT_S,
            what="the push thread to take the plan",
        )
        progress.begin_pass()
        for layer in range(LAYERS):
            progress.mark_layer_done(layer)
        time.sleep(0.05)  # a window for a wrong early send: none may happen in it
        assert gated == []  # deferred: nothing before the pass ended
        assert push.pass_ended(1)  # sent from this thread, at once
        assert gated == list(range(LAYERS))
        assert push.num_submit_calls == 1
        assert reached.wait(WAIT_S), "the target's counter never reached 2 writes x 4 layers"
        np.testing.assert_array_equal(dst, _expected(src))
        wait_until(
            lambda: push.num_passes == 1, timeout=WAIT_S, what="the push thread to finish the pass"
        )
    finally:
        push.close()


@pytest.mark.parametrize("progress_type", [LayerProgress, Counting])
def test_each_layer_goes_when_done(
    fabric: tuple[TransferEngine, TransferEngine], progress_type: type[LayerProgress]
) -> None:
    """Woken by the counter (or, for one that cannot notify, polling it)."""
    progress = progress_type(LAYERS)
    push, gated, src, dst, reached = _run_pass(fabric, True, progress)

    def num_gated(count: int) -> Callable[[], bool]:
        return lambda: len(gated) == count

    try:
        progress.begin_pass()
        for layer in range(LAYERS):
            progress.mark_layer_done(layer)
            wait_until(num_gated(layer + 1), timeout=WAIT_S, what=f"layer {layer} gated")
        assert gated == list(range(LAYERS))
        assert push.num_submit_calls == LAYERS
        assert reached.wait(WAIT_S), "the target's counter never reached 2 writes x 4 layers"
        np.testing.assert_array_equal(dst, _expected(src))
        assert not push.pass_ended(1)  # nothing left to send
    finally:
        push.close()


def test_writes_the_fabric_never_posted_go_to_on_not_posted_and_never_land() -> None:
    """Writes to a stopped target (SIGSTOP) pile up in the fabric's queue until their deadline
    fails them; of each failed call, those never posted go to ``on_not_posted`` (the messenger
    takes them back out of the count it reports) and only the posted ones to ``on_error``.
    Once the target runs again, exactly the writes not reported unposted land."""
    from tests.fabric.harness import RemoteTarget

    page, pages, items = 16 * 1024, 64, 16
    layer_bytes = pages * page
    target = RemoteTarget("tcp", LAYERS * layer_bytes)
    source = TransferEngine("tcp", op_timeout=2.0)
    try:
        handle, _ = source.register(np.ones(LAYERS * layer_bytes, dtype=np.uint8))
        peer = source.add_peer(target.address)
        rows = np.array([[i * page, i * page, page] for i in range(pages)], dtype=np.int64)
        ops = (RankOps(0, 0, rows),)
        per_layer = (layer_bytes, layer_bytes, pages, pages * page)
        plan = [
            PushItem(f"r{i}", 100 + i, peer, (target.descriptor,), ops, *per_layer)
            for i in range(items)
        ]
        lock = threading.Lock()
        counts = {"done": 0, "error": 0, "not_posted": 0}
        never_posted: dict[int, int] = {}

        def tally(kind: str, count: int) -> None:
            with lock:
                counts[kind] += count

        def not_posted(item: PushItem, count: int, num_bytes: int, _e: FabricError) -> None:
            assert num_bytes == count * page
            never_posted[item.imm] = never_posted.get(item.imm, 0) + count
            tally("not_posted", count)

        progress = LayerProgress(LAYERS)
        push = PushThread(
            source, [handle], progress, LAYERS, lambda item, layer: True,
            lambda _r, count: tally("done", count), lambda _r, count, _e: tally("error", count),
            layerwise=False, on_not_posted=not_posted,
        )  # fmt: skip
        pid = target.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            push.submit_pass(PassPlan(1, plan))
            progress.begin_pass()
            push.pass_ended(1)
            total = items * LAYERS * pages
            wait_until(
                lambda: sum(counts.values()) == total,
                timeout=WAIT_S,
                what="every write accounted for",
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        assert counts["not_posted"] > 0  # the scenario left writes in the queue
        push.close()
        for item in plan:
            landed = LAYERS * pages - never_posted.get(item.imm, 0)
            if landed:
                target.expect([item.imm], landed, timeout=60)
                assert target.wait_for("reached")["imm"] == item.imm
        assert target.stats()["received"] == total - counts["not_posted"]
    finally:
        source.close()
        target.close()
