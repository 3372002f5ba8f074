"""Plumbing for the messenger tests: a prefill worker in a spawned child, and the checks that
both sides are back to rest (waits use `tests.waiting.wait_until`)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.waiting import wait_until
from workers.kv.endpoint import PrefillEndpoint
from workers.service.prefill_process import prefill_process_main

if TYPE_CHECKING:
    from workers.service.kv_worker import DecodeWorker, PrefillWorker

SPAWN = multiprocessing.get_context("spawn")
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0


class RemotePrefill:
    """A `PrefillWorker` in a spawned process; the pipe carries JSON bytes only."""

    def __init__(
        self,
        model_dir: Path | str,
        provider: str,
        *,
        engine: dict[str, Any] | None = None,
        messenger: dict[str, Any] | None = None,
        num_threads: int | None = None,
        daemon: bool = True,
        wait: bool = True,
        env: dict[str, str] | None = None,
        nics: tuple[str, ...] = (),
    ) -> None:
        """``daemon=False`` for a TP prefill worker: a daemonic process cannot spawn its ranks
        (then `close` / `kill` must run, e.g. from a fixture's teardown). ``env``: variables
        set for the child only (e.g. libfabric's ``FI_TCP_PORT_*`` to pin its address).
        ``nics``: one transfer engine per entry (`workers.fabric.nics`)."""
        options = {
            "model_dir": str(model_dir),
            "provider": provider,
            "nics": list(nics),
            "engine": engine or {},
            "messenger": messenger or {},
            "num_threads": num_threads,
        }
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=prefill_process_main, args=(child, json.dumps(options).encode()), daemon=daemon
        )
        saved = {name: os.environ.get(name) for name in env or {}}
        os.environ.update(env or {})  # a spawned child copies the environment at start
        try:
            self.process.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        child.close()
        self.killed = False
        self.endpoint: PrefillEndpoint
        if wait:
            self.wait_started()

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> PrefillEndpoint:
        """Wait for the worker's endpoint (``wait=False`` lets the caller start other things)."""
        if not self.conn.poll(timeout):
            self.process.kill()
            raise TimeoutError("prefill worker did not start")
        try:
            self.endpoint = PrefillEndpoint.from_bytes(self.conn.recv_bytes())
        except EOFError:
            self.process.join(CALL_TIMEOUT_S)
            raise RuntimeError(
                f"prefill worker exited with code {self.process.exitcode} before it started"
            ) from None
        return self.endpoint

    def call(self, **command: Any) -> Any:
        self.conn.send_bytes(json.dumps(command).encode())
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"prefill worker did not answer {command}")
        return json.loads(self.conn.recv_bytes())

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.call(op="state")
        return state

    def stats(self, request_id: str) -> dict[str, Any]:
        stats: dict[str, Any] = self.call(op="stats", request_id=request_id)
        return stats

    def kill(self) -> None:
        self.killed = True
        pid = self.process.pid
        self.process.kill()
        self.process.join(CALL_TIMEOUT_S)
        # A killed shm endpoint cannot unlink its regions (fabric README).
        for leftover in Path("/dev/shm").glob(f"{pid}:*"):
            leftover.unlink(missing_ok=True)

    def close(self) -> int | None:
        if self.process.is_alive():
            try:
                self.conn.send_bytes(b'{"op": "close"}')
                self.conn.poll(CALL_TIMEOUT_S)
            except (OSError, EOFError):
                pass
            self.process.join(CALL_TIMEOUT_S)
        if self.process.is_alive():
            os.kill(self.process.pid or 0, signal.SIGKILL)
            self.process.join()
        self.conn.close()
        return self.process.exitcode


def decode_pool_full(decode: DecodeWorker, num_pages: int) -> bool:
    """A `DecodeWorker` is back to rest: every page free, none pinned, no transfer live."""
    state = decode.state()
    return (
        state["num_free_pages"] == num_pages
        and state["num_pinned_pages"] == 0
        and state["num_transfers"] == 0
    )


def decode_pages_back(decode: DecodeWorker, num_pages: int) -> bool:
    """Every page of a `DecodeWorker` free and none pinned, read from its engine: unlike
    `decode_pool_full` this holds for a decoder whose fabric was abandoned (its `state` raises)."""
    block_manager = decode.engine.block_manager
    return block_manager.num_free_pages == num_pages and block_manager.num_pinned_pages == 0


def prefill_pool_full(prefill: PrefillWorker | RemotePrefill, num_pages: int) -> bool:
    """A prefill worker is back to rest: every page free, no transfer live. Its `state` runs on
    its step loop: it raises if the loop died."""
    state = prefill.state()
    return state["num_free_pages"] == num_pages and state["num_transfers"] == 0


def wait_pools_full(
    prefill: PrefillWorker | RemotePrefill,
    decode: DecodeWorker,
    *,
    prefill_pages: int,
    decode_pages: int,
) -> None:
    """Wait until both workers are back to rest (nothing leaked on either side)."""
    wait_until(lambda: decode_pool_full(decode, decode_pages), what="decode pool full again")
    wait_until(lambda: prefill_pool_full(prefill, prefill_pages), what="prefill pool full again")
