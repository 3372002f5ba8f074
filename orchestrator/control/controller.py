"""The control plane: places worker groups on Ray, keeps the registry, checks health, replaces
failed workers and drains them on shutdown. Runs as asyncio tasks in the router's process.

Life cycle of one worker id (``decode-1``)::

    place (STRICT_PACK placement group, timeout) ─▶ actor.start() ─▶ healthy
      ─▶ health check fails (actor died, or no answer in time) ─▶ unhealthy: the router ends
         its requests there with an error ─▶ actor killed, group removed ─▶ placed again
    shutdown: drain (no new requests, running ones finish within grace) ─▶ stop ─▶ kill

A worker whose node cannot open the model (`ModelNotOnNodeError`, raised by the worker before
it loads anything) fails the start, or the scale, with that error; a replacement that meets it
is not retried: the worker stays unhealthy with the error in its record (``failure``) and in
the log, since every retry on that node would fail the same way.

Scaling a group while serving (`scale`): new replica ids are placed and started like the
first ones and join the router when healthy; a removed one (highest replica number first) is
*leaving*: ``draining`` in the registry, so the router picks it no more, never judged by health
checks nor replaced; once idle (nothing in flight from the router, nothing running, waiting or
transferring on it; at most ``grace_seconds``) it is drained, stopped and removed from the
registry (the router closes its link).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config.cluster import ClusterConfig, GroupConfig
from orchestrator.control.placement import (
    PlacementError,
    check_reachable,
    place_worker,
    remove_worker_placement,
    worker_bundles,
)
from orchestrator.control.registry import Registry, ScaleResult, WorkerRecord
from orchestrator.control.shutdown import off_loop
from orchestrator.errors import InvalidRequestError, ScaleInProgressError, UnavailableError
from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.service.actor import WorkerActor, WorkerSpec
from workers.service.model_dir import ModelNotOnNodeError
from workers.wire import CacheNaming, WorkerLoad

logger = logging.getLogger(__name__)

DISCARD_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class ControllerOptions:
    placement_timeout_seconds: float = 120.0
    start_timeout_seconds: float = 300.0
    health_interval_seconds: float = 2.0
    health_timeout_seconds: float = 10.0
    replace_failed: bool = True
    # A worker's whole prefix cache is fetched this often (its changes at every health check):
    # the router's index then drops what it recorded for requests whose KV was never cached.
    cache_resync_seconds: float = 60.0
    worker_metrics_port: int | None = 0  # each worker's /metrics (0: any free port; None: none)


def failure_text(error: BaseException) -> str:
    """``Type: message`` of a worker's failure to start, on one line: of a remote error its
    cause (Ray's text of it carries the remote traceback)."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, BaseException):
        error = error.cause
    return f"{type(error).__name__}: {str(error).strip().partition(chr(10))[0]}"


@dataclass
class _Placed:
    handle: Any
    group: Any


# How often a leaving worker is asked whether it is idle.
_IDLE_POLL_SECONDS = 0.2


class Controller:
    def __init__(
        self,
        config: ClusterConfig,
        registry: Registry,
        options: ControllerOptions | None = None,
        secret: str | None = None,
    ) -> None:
        """``secret``: the cluster's key as hex (`orchestrator.control.cluster_secret`); None:
        one drawn for this cluster."""
        self.config = config
        self.registry = registry
        self.options = options or ControllerOptions()
        self._placed: dict[str, _Placed] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._replacing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._replacing_stopped = False
        self._cluster_id = uuid.uuid4().hex[:8]
        self._leaving: set[str] = set()  # being scaled away: not judged, not replaced
        self._cache_synced: dict[str, float] = {}  # worker id -> when its whole cache came
        self._scaling = False
        # Handed to the workers (through Ray, with their spec): the MAC key of their KV control
        # messages (`workers.kv.protocol`) and the token of their gRPC service, which only the
        # router presents. A process outside the cluster can neither have a prefill worker act
        # on a request nor start a generation on a worker.
        self._secret = secret if secret is not None else secrets.token_hex(32)

    @property
    def secret(self) -> str:
        """The cluster's secret (hex): its router presents it to the workers' gRPC service."""
        return self._secret

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Place and start every worker of every group; raises if any cannot start."""
        starts = []
        for group in self.config.groups:
            for replica in range(group.replicas):
                worker_id = f"{group.role}-{replica}"
                self.registry.add(WorkerRecord(worker_id, group.role, replica, group.tp))
                starts.append(self._launch(group, worker_id))
        results = await asyncio.gather(*starts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self._health_task = asyncio.create_task(self._health_loop(), name="health-checks")

    def _spec(self, group: GroupConfig, worker_id: str) -> WorkerSpec:
        engine = dataclasses.asdict(self.config.engine_config(group.role))
        if group.tp > 1:
            if "tensor_parallel_size" not in {f.name for f in dataclasses.fields(EngineConfig)}:
                raise RuntimeError(f"groups.{group.role}.tp={group.tp}: engine lacks TP support")
            engine["tensor_parallel_size"] = group.tp
        fabric = group.fabric
        return WorkerSpec(
            worker_id=worker_id,
            role=group.role,
            model_dir=str(self.config.model),
            engine=engine,
            tp_size=group.tp,
            provider=fabric.provider if fabric else "tcp;ofi_rxm",
            fabric_node=fabric.node if fabric else None,
            fabric_nics=fabric.nic_entries if fabric else (),
            host=self.config.worker_host,
            transfer=self.config.transfer.model_dump(),
            metrics_port=self.options.worker_metrics_port,
            nice=group.nice,
            cluster_secret=self._secret,
        )

    async def _launch(self, group: GroupConfig, worker_id: str) -> None:
        spec = self._spec(group, worker_id)
        bundle = group.resources_per_rank.bundle()
        bundles = worker_bundles(bundle, group.tp)
        # Unique per controller and generation: several clusters may share one Ray cluster, and a
        # removed group's name is released asynchronously.
        generation = self.registry.workers[worker_id].generation
        name = f"pdserve-{self._cluster_id}-{worker_id}-g{generation}"
        placement = await place_worker(name, bundles, self.options.placement_timeout_seconds)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        actor_class: Any = ray.remote(WorkerActor)
        handle = actor_class.options(
            name=None,
            num_cpus=bundle.get("CPU", 0),
            # Every GPU of its bundle: under TP on CUDA its followers run on the others.
            num_gpus=bundles[0].get("GPU", 0),
            memory=bundle.get("memory"),
            resources=custom or None,
            max_concurrency=4,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=0
            ),
            runtime_env={
                "env_vars": {
                    "OMP_NUM_THREADS": str(group.threads),
                    "TOKENIZERS_PARALLELISM": "false",
                }
            },
        ).remote(spec.to_dict())
        self._placed[worker_id] = _Placed(handle, placement)
        try:
            info = await asyncio.wait_for(handle.start.remote(), self.options.start_timeout_seconds)
        except ModelNotOnNodeError as error:
            self._discard(worker_id)
            # Ray's wrapper (an instance of the cause's class too) carries the remote
            # traceback; the worker's own error says all there is to fix.
            raise ModelNotOnNodeError(
                error.worker_id, error.node, error.path, error.reason
            ) from None
        except BaseException:
            self._discard(worker_id)
            raise
        record = self.registry.workers[worker_id]
        record.address = info["address"]
        record.prefill_endpoint = info["prefill_endpoint"]
        record.metrics_port = info.get("metrics_port", 0)
        record.pid = info["pid"]
        record.node_ip = info["node_ip"]
        naming = info.get("cache_naming")
        record.cache_naming = None if naming is None else CacheNaming(**naming)
        try:
            check_reachable(self.config, record, self.registry.workers.values())
        except PlacementError:
            self._discard(worker_id)
            raise
        pages = info["num_total_kv_pages"]
        record.load = WorkerLoad(num_free_kv_pages=pages, num_total_kv_pages=pages)
        self.registry.set_health(worker_id, "healthy")
        logger.info("%s started (pid %s) at %s", worker_id, info["pid"], record.address or "-")

    def _discard(self, worker_id: str) -> None:
        placed = self._placed.pop(worker_id, None)
        if placed is None:
            return
        try:
            ray.kill(placed.handle, no_restart=True)
        except Exception:
            logger.debug("kill %s failed", worker_id, exc_info=True)
        remove_worker_placement(placed.group)

    # --- health and replacement ------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask every placed worker for its load now (GetClusterState reads the result)."""
        await asyncio.gather(
            *(self._check(worker_id) for worker_id in list(self._placed)), return_exceptions=True
        )

    async def _check(self, worker_id: str) -> None:
        placed = self._placed.get(worker_id)
        record = self.registry.workers.get(worker_id)
        if placed is None or record is None or record.health in ("starting", "unhealthy"):
            return
        if worker_id in self._leaving:
            return  # `scale` watches it until it stops
        try:
            state = await asyncio.wait_for(
                placed.handle.state.remote(), self.options.health_timeout_seconds
            )
        except (ray.exceptions.RayError, TimeoutError) as error:
            if self._closing or self._placed.get(worker_id) is not placed:
                return  # shutting down, or the actor asked was already replaced
            logger.error("%s failed its health check: %r", worker_id, error)
            self.registry.set_health(worker_id, "unhealthy")
            if (
                self.options.replace_failed
                and not self._replacing_stopped
                and worker_id not in self._replacing
            ):
                self._replacing.add(worker_id)
                task = asyncio.create_task(self._replace(worker_id), name=f"replace-{worker_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        # A late answer from an actor that failed another check meanwhile (and is being
        # replaced: `starting`, or `unhealthy`) says nothing of the worker now.
        if self._placed.get(worker_id) is not placed or record.health not in (
            "healthy",
            "draining",
        ):
            return
        # The counters the router and the cluster state read (not the per-position tuples).
        counters = dataclasses.asdict(WorkerLoad())
        ints: dict[str, Any] = {
            k: int(state[k]) for k, v in counters.items() if k in state and isinstance(v, int)
        }
        record.load = WorkerLoad(**ints)
        if state["health"] in ("healthy", "draining"):
            record.health = state["health"]
        if record.cache_naming is not None:
            await self._fetch_cache_events(worker_id, placed)

    async def _fetch_cache_events(self, worker_id: str, placed: _Placed) -> None:
        """Hand what the worker's prefix cache gained and lost to the registry's listeners (the
        router's index); the whole cache every ``cache_resync_seconds``, and after a batch that
        did not arrive (it is lost on the worker too: drained)."""
        now = time.monotonic()
        synced = self._cache_synced.pop(worker_id, None)
        full = synced is None or now - synced >= self.options.cache_resync_seconds
        try:
            events = await asyncio.wait_for(
                placed.handle.cache_events.remote(full), self.options.health_timeout_seconds
            )
        except (ray.exceptions.RayError, TimeoutError) as error:
            logger.debug("%s: prefix cache events not fetched: %r", worker_id, error)
            return  # the health check judges the worker
        self._cache_synced[worker_id] = now if full or synced is None else synced
        if events is not None and self._placed.get(worker_id) is placed:
            batch = CacheEventBatch(
                tuple(events["stored"]), tuple(events["removed"]), bool(events["reset"])
            )
            self.registry.publish_cache_events(worker_id, batch)

    async def _health_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.options.health_interval_seconds)
            await self.refresh()

    async def _replace(self, worker_id: str) -> None:
        record = self.registry.workers[worker_id]
        group = self.config.group(record.role)
        try:
            self._discard(worker_id)
            delay = 1.0
            while not self._closing:
                record.health = "starting"
                record.generation += 1
                try:
                    await self._launch(group, worker_id)
                    logger.info("%s replaced (generation %d)", worker_id, record.generation)
                    return
                except ModelNotOnNodeError as error:
                    # Its node lacks the model: every retry there would fail the same way.
                    record.health = "unhealthy"
                    record.failure = str(error)
                    logger.error("%s is not replaced: %s", worker_id, error)
                    return
                except Exception:
                    logger.exception("replacing %s failed; retrying in %.0f s", worker_id, delay)
                    record.health = "unhealthy"
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
        finally:
            self._replacing.discard(worker_id)

    # --- scaling -------------------------------------------------------------------------

    async def scale(
        self,
        role: str,
        replicas: int,
        *,
        grace_seconds: float,
        in_flight: Callable[[WorkerRecord], int] = lambda record: 0,
    ) -> ScaleResult:
        """Give group ``role`` ``replicas`` workers while serving (module docstring).
        ``in_flight(record)``: what the router still has on a worker (requests, or prompt
        tokens charged to a prefill worker); a leaving worker stops once it is 0 and the worker
        itself is idle. Raises `InvalidRequestError` (no such group, fewer than 1),
        `ScaleInProgressError` (another scale, or a worker of the group being replaced),
        `UnavailableError` (a new worker did not start: the others stay)."""
        try:
            group = self.config.group(role)
        except KeyError:
            raise InvalidRequestError(f"no group {role!r} in this cluster") from None
        if replicas < 1:
            raise InvalidRequestError(f"a group needs at least 1 replica, got {replicas}")
        if self._scaling:
            raise ScaleInProgressError("another scale of this cluster is in progress")
        current = sorted(self.registry.of_role(role), key=lambda r: r.replica)
        replacing = sorted(r.worker_id for r in current if r.worker_id in self._replacing)
        if replacing:
            raise ScaleInProgressError(
                f"{', '.join(replacing)} is being replaced; scale once it is back"
            )
        self._scaling = True
        try:
            if replicas > len(current):
                return await self._scale_up(group, current, replicas)
            leaving = current[replicas:]
            await asyncio.gather(
                *(self._remove(record, grace_seconds, in_flight) for record in leaving)
            )
            return ScaleResult(replicas, removed=tuple(r.worker_id for r in leaving))
        finally:
            self._scaling = False

    async def _scale_up(
        self, group: GroupConfig, current: list[WorkerRecord], replicas: int
    ) -> ScaleResult:
        first = max((r.replica for r in current), default=-1) + 1
        added = [f"{group.role}-{first + i}" for i in range(replicas - len(current))]
        for offset, worker_id in enumerate(added):
            self.registry.add(WorkerRecord(worker_id, group.role, first + offset, group.tp))
        results = await asyncio.gather(
            *(self._launch(group, worker_id) for worker_id in added), return_exceptions=True
        )
        failed = [w for w, r in zip(added, results, strict=True) if isinstance(r, BaseException)]
        for worker_id in failed:
            self._discard(worker_id)
            self.registry.remove(worker_id)
        if failed:
            first_error = next(r for r in results if isinstance(r, BaseException))
            raise UnavailableError(
                f"{', '.join(failed)} did not start ({failure_text(first_error)}); the group "
                f"has {replicas - len(failed)} replicas"
            )
        logger.info("%s scaled up to %d: %s", group.role, replicas, ", ".join(added))
        return ScaleResult(replicas, added=tuple(added))

    async def _remove(
        self,
        record: WorkerRecord,
        grace_seconds: float,
        in_flight: Callable[[WorkerRecord], int],
    ) -> None:
        worker_id = record.worker_id
        self._leaving.add(worker_id)
        self.registry.set_health(worker_id, "draining")  # the router picks it no more
        try:
            placed = self._placed.get(worker_id)
            if placed is not None:
                deadline = time.monotonic() + grace_seconds
                while time.monotonic() < deadline and not await self._idle(
                    placed, record, in_flight
                ):
                    await asyncio.sleep(_IDLE_POLL_SECONDS)
                await self._stop(worker_id, placed, max(0.0, deadline - time.monotonic()))
                await off_loop(
                    lambda: self._discard(worker_id),
                    DISCARD_TIMEOUT_SECONDS,
                    f"removing {worker_id}'s actor and placement group",
                )
        finally:
            self._leaving.discard(worker_id)
            self.registry.remove(worker_id)
        logger.info("%s scaled away", worker_id)

    async def _idle(
        self, placed: _Placed, record: WorkerRecord, in_flight: Callable[[WorkerRecord], int]
    ) -> bool:
        if in_flight(record):
            return False
        try:
            state = await asyncio.wait_for(
                placed.handle.state.remote(), self.options.health_timeout_seconds
            )
        except (ray.exceptions.RayError, TimeoutError):
            return True  # gone: nothing of it can finish
        busy = ("num_running_requests", "num_waiting_requests", "num_transfers_in_flight")
        return not any(int(state.get(key, 0)) for key in busy)

    def handle_of(self, worker_id: str) -> Any:
        """The Ray actor handle of a worker (tests kill one to check replacement)."""
        return self._placed[worker_id].handle

    # --- shutdown ------------------------------------------------------------------------

    def stop_replacing(self) -> None:
        """Replace no failed worker from now on (the router is draining: a replacement would
        serve nothing, and its placement would wait on a Ray that may be going away too)."""
        self._replacing_stopped = True

    async def _stop_tasks(self) -> None:
        self._closing = True
        if self._health_task is not None:
            self._health_task.cancel()
        # A replacement still being placed or started would otherwise finish after this
        # returns: a worker nobody stops, holding its placement group. Cancelled, `_launch`
        # discards what it had (`place_worker` removes a group it gave up on).
        replacing = list(self._tasks)
        for task in replacing:
            task.cancel()
        await asyncio.gather(*replacing, return_exceptions=True)

    async def shutdown(self, grace_seconds: float) -> None:
        """Drain every worker (running requests finish within grace), stop and remove them."""
        await self._stop_tasks()
        for record in self.registry.workers.values():
            if record.is_ready:
                record.health = "draining"
        placed = list(self._placed.items())
        await asyncio.gather(
            *(self._stop(worker_id, p, grace_seconds) for worker_id, p in placed),
            return_exceptions=True,
        )
        # Off the loop and bounded: removing a placement group waits for the GCS, which a
        # signal to the whole cgroup may have ended meanwhile.
        await off_loop(
            lambda: self._discard_all([worker_id for worker_id, _ in placed]),
            DISCARD_TIMEOUT_SECONDS,
            "removing the workers' actors and placement groups",
        )
        logger.info("control plane stopped %d workers", len(placed))

    def _discard_all(self, worker_ids: list[str]) -> None:
        for worker_id in worker_ids:
            self._discard(worker_id)

    async def abandon(self) -> None:
        """Stop the control plane without asking Ray anything: Ray is gone (its GCS does not
        answer), and with it what it knew of the workers."""
        await self._stop_tasks()
        self._placed.clear()
        logger.warning(
            "control plane: Ray is gone; %d workers not drained", len(self.registry.workers)
        )

    async def _stop(self, worker_id: str, placed: _Placed, grace_seconds: float) -> None:
        try:
            await asyncio.wait_for(placed.handle.drain.remote(grace_seconds), grace_seconds + 10)
            await asyncio.wait_for(placed.handle.stop.remote(), 30)
        except Exception as error:
            logger.warning("%s did not stop cleanly: %r", worker_id, error)
