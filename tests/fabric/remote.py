"""Child-process entry points for the fabric tests (spawn needs importable functions).

A child runs one `TransferEngine` and obeys JSON commands on a pipe; every reply is JSON too,
except `dump`, which returns the raw bytes of the child's registered buffer. Children exit 0
only if their engine closed cleanly and its threads ended.
"""

from __future__ import annotations

import faulthandler
import json
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from workers.fabric import FabricError, Message, TransferEngine


class _Pipe:
    """A connection shared by the main thread and engine callbacks."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.conn.send_bytes(json.dumps(message).encode())

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.conn.recv_bytes())
        return result


# An idle target polls this rarely (see `RemoteTarget.stop`); busy, it spins as usual.
TARGET_IDLE_WAIT_US = 20_000


def target_main(conn: Connection, provider: str, num_bytes: int) -> None:
    """A write target: registers `num_bytes`, publishes (address, descriptor), arms counters."""
    faulthandler.enable()  # a crash in native code shows its Python stacks in the test's output
    pipe = _Pipe(conn)
    engine = TransferEngine(provider, idle_wait_us=TARGET_IDLE_WAIT_US)
    buffer = np.zeros(num_bytes, dtype=np.uint8)
    _handle, descriptor = engine.register(buffer)
    pipe.send_bytes(engine.address)
    pipe.send_bytes(descriptor.to_bytes())

    def reached(imm: int) -> None:
        pipe.send({"event": "reached", "imm": imm})

    def failed(imm: int, error: FabricError) -> None:
        pipe.send({"event": "error", "imm": imm, "error": str(error)})

    while True:
        command = pipe.recv()
        op = command["op"]
        if op == "expect":
            for imm in command["imms"]:
                engine.expect_imm(
                    imm,
                    command["count"],
                    lambda imm=imm: reached(imm),
                    lambda error, imm=imm: failed(imm, error),
                    timeout=command.get("timeout"),
                )
            pipe.send({"event": "armed"})
        elif op == "cancel":
            pipe.send({"event": "cancelled", "had": engine.cancel_imm(command["imm"])})
        elif op == "stats":
            imm_stats = engine.stats().imm
            pipe.send({"event": "stats", **imm_stats.__dict__})
        elif op == "progress":
            pipe.send({"event": "progress", **engine.stats().progress.__dict__})
        elif op == "dump":
            pipe.send_bytes(buffer.tobytes())
        elif op == "close":
            break
    _close_and_exit(engine)


def sender_main(conn: Connection, provider: str, peer_address: bytes, num_messages: int) -> None:
    """Sends `num_messages` numbered messages to `peer_address`, then waits for "close"."""
    faulthandler.enable()
    pipe = _Pipe(conn)
    engine = TransferEngine(provider)
    peer = engine.add_peer(peer_address)
    done = threading.Semaphore(0)
    errors: list[str] = []
    for sequence in range(num_messages):
        engine.submit_send(
            peer,
            sequence.to_bytes(4, "little") * 4,
            on_done=done.release,
            on_error=lambda error: errors.append(str(error)),
        )
    pipe.send({"event": "submitted", "address": engine.address.hex(), "errors": errors})
    pipe.recv()
    _close_and_exit(engine)


def _close_and_exit(engine: TransferEngine) -> None:
    engine.close()
    alive = [thread.name for thread in engine.threads if thread.is_alive()]
    raise SystemExit(1 if alive else 0)


__all__ = ["Message", "sender_main", "target_main"]
