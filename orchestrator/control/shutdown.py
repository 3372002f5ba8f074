"""How `pdserve serve` stops: the first SIGINT or SIGTERM starts the drain, a second one during
it ends the process at once; and the stop's blocking calls, bounded and off the event loop.

Exit statuses: 0 after the drain, whichever of the two signals and wherever it was sent (the pid,
its process group, every process of its cgroup); ``128 + N`` when a second signal N cut the
drain short (130 for SIGINT, 143 for SIGTERM), as a shell reports a process that signal killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT / SIGTERM on the running loop: the first sets `stopping`, a later one calls
    ``on_second`` with its number (which ends the process)."""

    def __init__(self, on_second: Callable[[int], None]) -> None:
        self.stopping = asyncio.Event()
        self.first: int | None = None
        self._on_second = on_second

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._received, signum)

    def _received(self, signum: int) -> None:
        if self.first is None:
            self.first = signum
            self.stopping.set()
        else:
            self._on_second(signum)

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name


async def off_loop(call: Callable[[], T], timeout_seconds: float, what: str) -> T | None:
    """``call()`` in a daemon thread, awaited for at most ``timeout_seconds``; None (and a
    warning naming ``what``) if it has not returned by then. Ray's synchronous calls wait for a
    GCS that may be gone: on the loop they would block the drain and a second signal's
    handling, and in the loop's default executor the interpreter's exit too."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = call()
        except BaseException as raised:
            error = raised
        # RuntimeError: the loop closed meanwhile, and nobody waits any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=what, daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout_seconds)
    except TimeoutError:
        logger.warning(
            "%s did not finish within %.0f s; going on without it", what, timeout_seconds
        )
        return None
