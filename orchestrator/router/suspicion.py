"""Workers the router stops choosing before the controller noticed anything: their Connect
stream broke (the worker died, or its host is unreachable) or they refused a request as
unavailable (closing, step loop dead, KV fabric unusable).

A mark holds until the controller replaced the worker (its record has a new generation and
address) or its hold time passed (a break that was not the worker's death), so no request is
sent to a dead worker while the controller's health check has not yet noticed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.control.registry import WorkerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Mark:
    generation: int
    address: str
    until: float


class Suspects:
    """``clock``: seconds, monotonic (tests pass their own, to pass a hold without waiting)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._marks: dict[str, _Mark] = {}

    def mark(self, worker: WorkerRecord, hold_seconds: float, why: str) -> None:
        until = self._clock() + hold_seconds
        self._marks[worker.worker_id] = _Mark(worker.generation, worker.address, until)
        logger.warning("%s: %s; not routing to it until it is replaced", worker.worker_id, why)

    def is_suspect(self, worker: WorkerRecord) -> bool:
        """Cleared by a replacement (the controller bumps the generation and the worker has a
        new address) or when the hold time passed."""
        mark = self._marks.get(worker.worker_id)
        if mark is None:
            return False
        if (worker.generation, worker.address) != (mark.generation, mark.address) or (
            self._clock() >= mark.until
        ):
            del self._marks[worker.worker_id]
            return False
        return True
