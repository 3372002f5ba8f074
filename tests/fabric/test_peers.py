"""Peers of an engine: one handle per address however threads race, forgetting a peer and its
address-vector entry, and ops stranded at a failed peer."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from tests.waiting import wait_until
from workers.fabric import AddressError, TransferEngine
from workers.fabric.handles import PeerHandle

MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


@contextmanager
def _stranded_writes(engine: TransferEngine, target: RemoteTarget) -> Iterator[PeerHandle]:
    """Stop ``target`` (SIGSTOP) after a first write connected to it, post 64 MiB of writes
    to it and wait until their deadline failed the call with ops still posted (a stopped peer
    takes nothing). The target runs again (`resume`) when the block ends."""
    handle, _ = engine.register(np.ones(64 * MIB, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    first = threading.Event()
    engine.submit_write(handle, 0, peer, target.descriptor, 0, 64, imm=4, on_done=first.set)
    assert first.wait(30)
    target.stop()
    try:
        ended = threading.Event()
        ops = np.array([[i * MIB, i * MIB, MIB] for i in range(64)], dtype=np.int64)
        engine.submit_writes(
            handle, peer, target.descriptor, ops, imm=5, on_error=lambda _e: ended.set()
        )
        assert ended.wait(60)
        assert engine.stats().progress.ops_stranded > 0
        yield peer
    finally:
        target.resume()


def test_ops_stranded_at_a_failed_peer_let_the_progress_thread_sleep(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """Ops posted to a peer that then failed may never complete (shm: a dead peer's never
    do). They count as stranded and do not keep the progress thread spinning a core: it
    sleeps on the CQ as when idle, and still frees them if they do complete."""
    target = make_target(64 * MIB)
    engine = make_engine(op_timeout=2.0)
    with _stranded_writes(engine, target):
        sleeps = engine.stats().progress.sleeps
        wait_until(lambda: engine.stats().progress.sleeps >= sleeps + 20, what="20 sleeps")
    # The peer runs again: the stranded ops complete and their contexts come back.
    wait_until(lambda: engine.stats().progress.ops_stranded == 0, what="no stranded op")

    def all_ended() -> bool:
        stats = engine.stats().progress
        return stats.ops_completed + stats.error_completions == stats.ops_posted

    wait_until(all_ended, what="every posted op ended")


def test_forget_peer_removes_its_entry_once_nothing_is_posted_to_it(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """fi_av(3): ops in progress on a removed address are undefined, so the entry of a
    forgotten peer with ops still posted goes only when the last of them completed."""
    target = make_target(64 * MIB)
    engine = make_engine(op_timeout=2.0)
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    with _stranded_writes(engine, target) as old:
        engine.forget_peer(target.address)
        assert engine.stats().progress.peers_removed == 0  # ops to it are still posted
        with pytest.raises(AddressError):  # a forgotten handle is refused
            engine.submit_write(handle, 0, old, target.descriptor, 0, 64)
    wait_until(lambda: engine.stats().progress.peers_removed == 1, what="the entry removed")
    peer = engine.add_peer(target.address)  # resolved afresh, healthy
    assert peer is not old and engine.peer_failure(target.address) is None
    done = threading.Event()
    engine.submit_write(handle, 0, peer, target.descriptor, 0, 4096, on_done=done.set)
    assert done.wait(30)


def test_forgotten_peers_leave_the_address_vector(
    provider: str, make_engine: Callable[..., TransferEngine]
) -> None:
    """shm's address vector holds 256 entries: forgetting removes them, so a 257th peer
    incarnation can still be added."""
    engine = make_engine()
    incarnations = 300 if provider == "shm" else 20
    for _ in range(incarnations):
        peer_engine = TransferEngine(provider, num_receive_buffers=1, num_send_buffers=1)
        try:
            engine.add_peer(peer_engine.address)
            engine.forget_peer(peer_engine.address)
        finally:
            peer_engine.close()
    assert engine.stats().progress.peers_removed == incarnations


def test_concurrent_add_peer_returns_one_handle(
    make_engine: Callable[..., TransferEngine],
) -> None:
    target = make_engine()
    engine = make_engine()
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    for _ in range(20):
        engine.forget_peer(target.address)
        barrier = threading.Barrier(4)
        handles: list[Any] = [None] * 4

        def add(
            index: int, barrier: threading.Barrier = barrier, handles: list[Any] = handles
        ) -> None:
            barrier.wait()
            handles[index] = engine.add_peer(target.address)

        threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(h is handles[0] for h in handles), handles
        done = threading.Event()
        engine.submit_write(handle, 0, handles[0], descriptor, 0, 16, on_done=done.set)
        assert done.wait(30)
