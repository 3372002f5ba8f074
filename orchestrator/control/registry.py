"""The registry of live workers: what the router and decoders read, what the controller writes.

One `WorkerRecord` per worker id (``decode-2``), kept across replacements (``generation`` counts
them). Only the controller changes records (and adds or removes them when a group is scaled);
listeners hear when a worker leaves service so the router can end the requests it had there
(with an error, never a hang), and what the workers' prefix caches gained and lost (the
router's ``kv_aware`` index).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.cache_events import CacheEventBatch
from workers.wire import CacheNaming, WorkerLoad

logger = logging.getLogger(__name__)

HEALTH_STATES = ("starting", "healthy", "draining", "unhealthy")


@dataclass
class WorkerRecord:
    """``address``: the worker's token service (``host:port``; empty on prefill workers).
    ``prefill_endpoint``: prefill workers' serialized fabric address and KV sharding
    (`workers.kv.endpoint.PrefillEndpoint`), handed to decoders per request.
    ``metrics_port``: the worker's ``/metrics`` port on its host (0: it serves none).
    ``pid``: its (TP leader's) process id on its host, 0 until started.
    ``node_ip``: the IP of the Ray node it runs on, empty until started.
    ``cache_naming``: how it names its prefix cache's pages (None: caching off).
    ``failure``: why the controller stopped replacing it (empty while it serves or is
    replaced)."""

    worker_id: str
    role: str
    replica: int
    tp_size: int = 1
    health: str = "starting"
    address: str = ""
    prefill_endpoint: bytes = b""
    metrics_port: int = 0
    pid: int = 0
    node_ip: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    generation: int = 0
    cache_naming: CacheNaming | None = None  # None: no prefix cache (or not started)
    failure: str = ""

    @property
    def is_ready(self) -> bool:
        return self.health == "healthy"


WorkerListener = Callable[[WorkerRecord], None]
CacheEventListener = Callable[[WorkerRecord, CacheEventBatch], None]


@dataclass(frozen=True)
class ScaleResult:
    """A group's size after `Controller.scale`, and the worker ids it started and stopped."""

    replicas: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self._on_down: list[WorkerListener] = []
        self._on_cache_events: list[CacheEventListener] = []

    def add(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record

    def ready(self, role: str) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role == role and w.is_ready]

    def of_role(self, role: str) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role == role]

    def on_worker_down(self, listener: WorkerListener) -> None:
        self._on_down.append(listener)

    def on_cache_events(self, listener: CacheEventListener) -> None:
        self._on_cache_events.append(listener)

    def publish_cache_events(self, worker_id: str, batch: CacheEventBatch) -> None:
        """What a worker's prefix cache gained and lost (the controller fetches it)."""
        record = self.workers.get(worker_id)
        if record is None:
            return
        for listener in self._on_cache_events:
            try:
                listener(record, batch)
            except Exception:
                logger.exception("cache-events listener failed for %s", worker_id)

    def set_health(self, worker_id: str, health: str) -> None:
        record = self.workers[worker_id]
        was_ready = record.is_ready
        record.health = health
        if was_ready and health == "unhealthy":
            self._down(record)

    def remove(self, worker_id: str) -> None:
        """The worker left the cluster for good (scaled down): listeners hear it as down."""
        record = self.workers.pop(worker_id, None)
        if record is not None:
            self._down(record)

    def _down(self, record: WorkerRecord) -> None:
        for listener in self._on_down:
            try:
                listener(record)
            except Exception:
                logger.exception("worker-down listener failed for %s", record.worker_id)
