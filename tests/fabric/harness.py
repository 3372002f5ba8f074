"""Parent-side plumbing: spawned children and the engines a test opens."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

from tests.fabric import remote
from tests.waiting import wait_until
from workers.fabric import MemoryRegionDescriptor, TransferEngine

SPAWN = multiprocessing.get_context("spawn")
CHILD_TIMEOUT_S = 30.0


class RemoteTarget:
    """A child process running `remote.target_main`."""

    def __init__(self, provider: str, num_bytes: int) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.process: BaseProcess = SPAWN.Process(
            target=remote.target_main, args=(child_conn, provider, num_bytes), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.address = self._recv_bytes()
        self.descriptor = MemoryRegionDescriptor.from_bytes(self._recv_bytes())
        self.events: list[dict[str, Any]] = []
        self.killed = False

    def stop(self) -> None:
        """SIGSTOP the target once it is idle (`resume` continues it). On shm every
        post to it takes its region's lock, which its progress thread also takes on each poll:
        stopped inside, it would block the initiator's posts (the watchdog's case, not the one
        these tests stop it for). Idle (past its idle spin, 2 ms after its last work), the
        target's progress thread sleeps in waits of `remote.TARGET_IDLE_WAIT_US` between polls,
        so a stop once it has begun two of them rarely lands inside a poll."""
        sleeps = self.progress()["sleeps"]
        wait_until(lambda: self.progress()["sleeps"] >= sleeps + 2, what="an idle target")
        os.kill(self.process.pid or 0, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid or 0, signal.SIGCONT)

    def kill(self) -> None:
        self.killed = True
        self.process.kill()
        self.process.join(CHILD_TIMEOUT_S)
        if self.address.startswith(b"fi_shm://"):
            # A killed shm endpoint cannot unlink its region; do it for it.
            name = self.address[len(b"fi_shm://") :].rstrip(b"\0").decode()
            Path("/dev/shm", name).unlink(missing_ok=True)

    def _recv_bytes(self) -> bytes:
        if not self.conn.poll(CHILD_TIMEOUT_S):
            raise TimeoutError("child did not answer")
        return self.conn.recv_bytes()

    def _send(self, **command: Any) -> None:
        self.conn.send_bytes(json.dumps(command).encode())

    def next_event(self, timeout: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError("no event from the child")
        event: dict[str, Any] = json.loads(self.conn.recv_bytes())
        return event

    def poll_event(self, timeout: float) -> dict[str, Any] | None:
        return self.next_event(timeout) if self.conn.poll(timeout) else None

    def wait_for(self, name: str) -> dict[str, Any]:
        """Next event called `name`; events of other names that arrive first are kept in
        `events`, where a later wait for their name finds them."""
        for index, kept in enumerate(self.events):
            if kept["event"] == name:
                return self.events.pop(index)
        while True:
            event = self.next_event()
            if event["event"] == name:
                return event
            self.events.append(event)

    def expect(self, imms: list[int], count: int, timeout: float | None = None) -> None:
        self._send(op="expect", imms=imms, count=count, timeout=timeout)
        self.wait_for("armed")

    def cancel(self, imm: int) -> bool:
        self._send(op="cancel", imm=imm)
        return bool(self.wait_for("cancelled")["had"])

    def stats(self) -> dict[str, Any]:
        self._send(op="stats")
        return self.wait_for("stats")

    def progress(self) -> dict[str, Any]:
        """The target engine's `ProgressStats`, as a dict."""
        self._send(op="progress")
        return self.wait_for("progress")

    def dump(self) -> bytes:
        self._send(op="dump")
        return self._recv_bytes()

    def close(self) -> int | None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._send(op="close")
            self.process.join(CHILD_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        return self.process.exitcode


class Sender:
    """A child process running `remote.sender_main` (messages to `peer_address`)."""

    def __init__(self, provider: str, peer_address: bytes, num_messages: int) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=remote.sender_main,
            args=(child_conn, provider, peer_address, num_messages),
            daemon=True,
        )
        self.process.start()
        child_conn.close()

    def submitted(self) -> dict[str, Any]:
        assert self.conn.poll(CHILD_TIMEOUT_S), "sender did not report"
        result: dict[str, Any] = json.loads(self.conn.recv_bytes())
        return result

    def close(self) -> int | None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(b"{}")
        self.process.join(CHILD_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        return self.process.exitcode


def assert_rows_landed(target: np.ndarray, source: np.ndarray, rows: np.ndarray) -> None:
    """Every row ``(src, dst, length)`` of ``source`` is in ``target``, and nothing else is."""
    written = np.zeros(target.size, dtype=bool)
    for src, dst, length in rows.tolist():
        assert np.array_equal(target[dst : dst + length], source[src : src + length])
        written[dst : dst + length] = True
    assert not target[~written].any()


def close_engine(engine: TransferEngine) -> None:
    engine.close()
    assert not any(thread.is_alive() for thread in engine.threads), "engine threads leaked"


__all__ = ["SPAWN", "Connection", "RemoteTarget", "Sender", "assert_rows_landed", "close_engine"]


class StuckPosts:
    """NAMED TEST FAULT, in place of ``workers.fabric.progress.lib`` (where the fabric posts):
    once ``armed``, a send or write posted by ``thread`` (None: any thread) blocks until
    ``release``, then reports that nothing was posted. A post that never returns (on shm, to a
    peer stopped or killed while it held its region lock) cannot be produced on demand, and
    over tcp a post never blocks."""

    def __init__(self, real: Any, thread: threading.Thread | None = None) -> None:
        self.real = real
        self.thread = thread
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _stuck(self) -> bool:
        if not self.armed.is_set() or self.thread not in (None, threading.current_thread()):
            return False
        self.entered.set()
        self.release.wait(60)
        return True

    def pd_post_send(self, *args: Any) -> int:
        return int(-self.real.FI_EAGAIN) if self._stuck() else int(self.real.pd_post_send(*args))

    def pd_post_writes(self, *args: Any) -> int:
        if self._stuck():
            args[-1][0] = -self.real.FI_EAGAIN  # rc_out: nothing posted
            return 0
        return int(self.real.pd_post_writes(*args))


class StuckPoll:
    """NAMED TEST FAULT, in place of ``workers.fabric.completions.lib`` (where the fabric reads
    its CQ): once ``armed``, a CQ poll blocks until ``release``, then reports that it read
    nothing. On shm a poll that never returns (it progresses commands of a peer killed while it
    held its region lock) happened in a CI run, but cannot be produced on demand."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def pd_poll(self, *args: Any) -> int:
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(60)
            return 0
        return int(self.real.pd_poll(*args))
