"""Ray for `pdserve serve`: join a cluster, or start an embedded one that a signal meant for
pdserve does not reach; tell whether Ray still answers; end the embedded one.

Supervisors stop a service by signalling its process group (``kill -TERM -PGID``, many CI
runners) or its whole cgroup (systemd's default ``KillMode=control-group``). ``ray.init()``
starts the GCS, the raylet and Ray's helper processes as children in the caller's process
group, so a group SIGTERM reaches them too: the GCS stops serving at once, the raylet ends the
workers, and a drain that asks Ray anything waits for Ray's 60 s GCS timeout. Started here, each
of those processes leads a session of its own (what Ray itself does with process groups on
Windows), so a group signal reaches pdserve alone, which drains the workers and then ends Ray.
They still die with this process: Ray sets ``PR_SET_PDEATHSIG`` on them ("kernel fate
sharing"), which a new session keeps; without it (not Linux) Ray's reaper needs them in our
group, and they stay there. The worker processes are the raylet's children, each in a process
group of its own (Ray's per-worker process groups).

A signal to every process of the cgroup still reaches Ray's: then Ray is gone when the drain
asks it (`gcs_answers` says so within a second) and `EmbeddedRay.kill` ends what is left of it
by pid. A driver whose GCS is gone cannot disconnect (Ray's ``shutdown`` waits for it), so such
a process ends through `exit_abandoning_ray` instead of the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from orchestrator.control.processes import (
    Proc,
    children,
    descendants,
    end,
    identify,
    is_running,
)

logger = logging.getLogger(__name__)

_abandoned = False  # this process's Ray driver could not disconnect: see `exit_abandoning_ray`


def ray_environment() -> None:
    """A Ray this process starts or joins sends no usage stats."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts worker processes at nice 15 by default; our workers are the inference engines,
    # and at nice 15 any ordinary process on the host starves them until they miss health checks
    # (seen with a load generator on the same host). Applies to a Ray this process starts.
    os.environ.setdefault("RAY_worker_niceness", "0")


@dataclass
class EmbeddedRay:
    """The Ray processes this process started (GCS, raylet, Ray's helpers) and, as they are
    seen, everything below them (the workers, Ray's agents)."""

    head: frozenset[Proc]
    seen: set[Proc] = field(default_factory=set)

    def look(self, worker_pids: Iterable[int] = ()) -> set[Proc]:
        """Record the processes running below the head now (and ``worker_pids``, the workers'
        own: once the raylet is gone they are no one's children); returns all recorded."""
        self.seen |= descendants(proc.pid for proc in self.head if is_running(proc))
        self.seen |= {proc for proc in map(identify, worker_pids) if proc is not None}
        return set(self.head) | self.seen

    def kill(self, worker_pids: Iterable[int], grace_seconds: float = 2.0) -> None:
        """End every process of this Ray still running (workers first: without their raylet
        nothing else stops them); logs what had to be ended."""
        procs = self.look(worker_pids)
        left = {proc for proc in procs if is_running(proc)}
        if not left:
            return
        below = left - self.head
        killed = end(below, grace_seconds) | end(left & self.head, grace_seconds)
        logger.warning(
            "ended %d leftover Ray processes by pid%s",
            len(left),
            f" ({len(killed)} with SIGKILL)" if killed else "",
        )


@contextlib.contextmanager
def _own_sessions() -> Iterator[None]:
    """Processes Ray starts meanwhile (through ``ray._private.services.ConsolePopen``) each lead
    a new session. Only with kernel fate sharing: otherwise they stay in our group, where Ray's
    reaper finds them."""
    try:
        from ray._private import services, utils
    except ImportError:
        logger.warning("Ray's process start is not where expected: its processes share our group")
        yield
        return
    popen = getattr(services, "ConsolePopen", None)
    if popen is None or not utils.detect_fate_sharing_support():
        logger.warning("Ray's processes share our process group: a group signal reaches them")
        yield
        return

    class _OwnSession(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _OwnSession  # type: ignore[misc]
    try:
        yield
    finally:
        services.ConsolePopen = popen  # type: ignore[misc]


def connect_ray(address: str | None, num_cpus: int | None = None) -> EmbeddedRay | None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``, as inside a Ray job), else start an
    embedded local one. Returns the embedded Ray that this process started (and so ends)."""
    ray_environment()
    import ray

    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return None
    # An embedded single-node Ray stays on loopback. Only here: on Linux the same setting makes
    # a joining node (``ray start --address``) refuse to start, so a cluster never gets it.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    before = children(os.getpid())
    with _own_sessions():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return EmbeddedRay(frozenset(children(os.getpid()) - before))


def embeds_ray(address: str | None) -> bool:
    """Whether `connect_ray` (with this ``address``) would start a local Ray."""
    ray_environment()
    import ray

    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))


def gcs_answers(timeout_seconds: float = 1.0) -> bool:
    """Whether the GCS of the Ray this process is connected to answers within the timeout
    (blocking: call it off the event loop). False when Ray is not initialized; True when this
    Ray offers no way to ask (the stop's steps are bounded anyway)."""
    import ray

    if not ray.is_initialized():
        return False
    worker: Any = ray._private.worker.global_worker
    client = getattr(worker, "gcs_client", None)
    if client is None or not hasattr(client, "internal_kv_get"):
        return True
    try:
        client.internal_kv_get(b"pdserve-liveness", namespace=b"pdserve", timeout=timeout_seconds)
    except Exception as error:
        logger.warning("Ray's GCS does not answer: %s", error)
        return False
    return True


def shutdown_ray() -> bool:
    """``ray.shutdown()``, waiting for the processes it ends where this Ray can (blocking: call
    it off the event loop). Returns True once done."""
    import ray

    if "wait_for_processes" in inspect.signature(ray.shutdown).parameters:
        ray.shutdown(wait_for_processes=True)
    else:
        ray.shutdown()
    return True


def abandon_ray() -> None:
    """This process's Ray driver cannot disconnect (its GCS is gone): end the process with
    `exit_abandoning_ray`, not through Ray's exit hook, which would wait for the GCS."""
    global _abandoned
    _abandoned = True


def ray_abandoned() -> bool:
    return _abandoned


def exit_abandoning_ray(code: int) -> None:
    """Exit now with ``code``, after flushing what was written, skipping the interpreter's exit
    handlers (Ray's would wait for a GCS that is gone). Never returns."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
