"""One worker as a Ray actor: an engine backend in its role plus its gRPC token service.

The controller wraps `WorkerActor` with ``ray.remote(...)`` (placement group, one bundle per TP
rank). Every method takes and returns plain data (str, int, bytes, dicts of them): nothing of
ours is pickled, Ray's own transport and the exceptions it carries back aside.

``start()`` checks that its node has the model (`workers.service.model_dir`:
`ModelNotOnNodeError` otherwise), loads it, registers KV memory (decode / prefill) and binds the
token service; it returns what the registry needs: the gRPC address (mixed, decode), the prefill
endpoint descriptor bytes (prefill), the TP layout and the KV pool size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from workers.log import configure_logging
from workers.netaddr import WILDCARD_HOSTS, join_host_port

if TYPE_CHECKING:
    from workers.service.backend import WorkerBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start; travels as a plain dict."""

    worker_id: str
    role: str
    model_dir: str
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    tp_size: int = 1
    provider: str = "tcp;ofi_rxm"
    # FabricConfig.node: the transfer engine's address; None: this Ray node's IP.
    fabric_node: str | None = None
    # FabricConfig.nics as a list: one transfer engine per entry (interface names or addresses
    # of the host the worker lands on, resolved there); empty: ``auto``, one on fabric_node.
    fabric_nics: tuple[str, ...] = ()
    # ClusterConfig.worker_host: where gRPC and /metrics listen; None: this Ray node's IP.
    host: str | None = None
    # ClusterConfig.transfer (`TransferConfig` as a dict).
    transfer: dict[str, Any] = field(default_factory=dict)
    metrics_port: int | None = 0  # the worker's /metrics on ``host`` (0: any free; None: none)
    nice: int = 0  # GroupConfig.nice: CPU priority of the process and of every thread it starts
    # The cluster's secret (hex): the MAC key of KV control messages between its workers
    # (`workers.kv.protocol`) and the token the router presents to their gRPC service
    # (`workers.token_auth`); empty: none.
    cluster_secret: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSpec:
        return cls(**data)


def node_ip() -> str:
    """The IP of the Ray node this process runs on (the pod's IP on Kubernetes)."""
    import ray

    address: str = ray.util.get_node_ip_address()
    return address


def advertised_address(bind_host: str, port: int) -> str:
    """``host:port`` the router dials for a service bound to ``bind_host``: that host itself,
    or for a wildcard this Ray node's IP."""
    return join_host_port(node_ip() if bind_host in WILDCARD_HOSTS else bind_host, port)


def lower_cpu_priority(nice: int) -> None:
    """Run this process at ``nice`` (never raised above where it already is).

    Linux keeps a nice value per thread, and a new thread (TP rank processes too) inherits its
    creator's: so every thread running now is set, and what starts later follows."""
    if nice <= 0:
        return
    task_dir = "/proc/self/task"
    threads = [int(tid) for tid in os.listdir(task_dir)] if os.path.isdir(task_dir) else [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:  # the thread ended meanwhile
            continue


class WorkerActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = WorkerSpec.from_dict(spec)
        lower_cpu_priority(self.spec.nice)
        # Ray gives num_cpus<=1 actors OMP_NUM_THREADS=1; say so for torch's intra-op pool too.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self._backend: WorkerBackend | None = None
        self._server: Any = None
        self._metrics: Any = None
        configure_logging(origin=self.spec.worker_id)

    def start(self) -> dict[str, Any]:
        from workers.engine.compute_thread import build_on_passing_thread
        from workers.engine.config import EngineConfig
        from workers.service.factory import create_backend
        from workers.service.model_dir import check_model_dir
        from workers.service.server import WorkerServer, WorkerServicer

        spec = self.spec
        config = EngineConfig(**spec.engine)
        # Unpinned, the token service and a tcp transfer engine take the address of the node
        # the worker landed on: what a worker on another node can reach. (Other providers pick
        # their own interface: an RDMA NIC's address is not the node's Ray address.)
        node = node_ip()
        # Before anything loads: a node without the model fails in one line that names it.
        check_model_dir(spec.worker_id, node, spec.model_dir)
        host = spec.host or node
        fabric_node = spec.fabric_node or (node if spec.provider == "tcp;ofi_rxm" else None)
        # Loaded on a thread that ends: the step loop's OpenMP team is then the process's only
        # one (see `workers.engine.compute_thread`).
        self._backend = build_on_passing_thread(
            lambda: create_backend(
                spec.role,
                spec.model_dir,
                config,
                provider=spec.provider,
                node=fabric_node,
                transfer=spec.transfer,
                secret=bytes.fromhex(spec.cluster_secret) or None,
                nics=tuple(spec.fabric_nics),
            )
        )
        address = ""
        if spec.role != "prefill":
            self._server = WorkerServer(
                WorkerServicer(spec.worker_id, self._backend, config.max_num_seqs),
                host,
                token=spec.cluster_secret or None,
            )
            address = advertised_address(host, self._server.port)
        metrics_port = 0
        if spec.metrics_port is not None:
            from workers.service.metrics import WorkerMetricsExporter

            self._metrics = WorkerMetricsExporter(self._backend, spec.role, spec.model_dir)
            metrics_port = self._metrics.start(host, spec.metrics_port)
        load = self._backend.load()
        naming = self._backend.cache_naming()
        logger.info("%s (%s) ready at %s", spec.worker_id, spec.role, address or "fabric only")
        return {
            "worker_id": spec.worker_id,
            "role": spec.role,
            "address": address,
            "prefill_endpoint": self._backend.prefill_endpoint(),
            "tp_size": spec.tp_size,
            "num_total_kv_pages": load.num_total_kv_pages,
            "metrics_port": metrics_port,
            "pid": os.getpid(),
            "node_ip": node,
            "cache_naming": None if naming is None else asdict(naming),
        }

    def state(self) -> dict[str, Any]:
        if self._backend is None:
            return {"health": "starting"}
        load = self._backend.load()
        draining = self._server is not None and self._server.servicer.draining
        return {"health": "draining" if draining else "healthy", **asdict(load)}

    def cache_events(self, full: bool = False) -> dict[str, Any] | None:
        """The prefix cache's changes since the last call (``full``: all it holds, as a reset),
        as plain data (`workers.engine.cache_events`); None before the start or with caching
        off. One reader only (the controller): each call takes what the previous one left."""
        batch = self._backend.cache_events(full) if self._backend is not None else None
        return None if batch is None else asdict(batch)

    def transfer_stats(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """KV transfer records of recent requests (plain data; prefill and decode roles)."""
        if self._backend is None:
            return {}
        found = {rid: self._backend.transfer_stats(rid) for rid in request_ids}
        return {rid: stats for rid, stats in found.items() if stats is not None}

    def step_trace(self) -> dict[str, Any]:
        """The engine's recent steps with this worker's id and role (`workers.engine.step_trace`)."""
        if self._backend is None:
            raise RuntimeError(f"{self.spec.worker_id} has not started")
        return {
            "worker_id": self.spec.worker_id,
            "role": self.spec.role,
            **self._backend.step_trace(),
        }

    def drain(self, grace_seconds: float) -> None:
        if self._server is not None:
            self._server.drain(grace_seconds)

    def stop(self) -> None:
        try:
            if self._metrics is not None:
                self._metrics.stop()
            if self._server is not None:
                self._server.stop()
        finally:
            if self._backend is not None:
                self._backend.close()
            self._backend = self._server = self._metrics = None
