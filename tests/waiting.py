"""The suite's one way to wait for a state: poll a condition until it holds.

The timeout is a bound, not a timing assertion: a test waits for something that must eventually
happen, and fails naming it if it never does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.01)


async def wait_until_async(
    condition: Callable[[], bool], timeout: float = 60.0, what: str = ""
) -> None:
    """`wait_until` inside a coroutine: the event loop keeps running between the looks."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.01)
