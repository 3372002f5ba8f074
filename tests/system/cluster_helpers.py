"""A served cluster on Ray for the end-to-end tests (tiny preset, real gRPC).

`ServedCluster` runs `orchestrator.control.app.ServingApp` on an event loop of a background
thread, so that tests can use blocking or asyncio clients alike. The Ray settings and the
session's in-process Ray (``ray_local``) are in ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from orchestrator.config.cluster import ClusterConfig

T = TypeVar("T")


def cluster_config(model_dir: Path, groups: dict[str, Any], **overrides: Any) -> ClusterConfig:
    raw: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "page_size": 16,
        "limits": {
            "max_model_len": 256,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "num_pages": 64,
        },
        "groups": groups,
        "router": {
            "address": "127.0.0.1:0",
            "http_address": "127.0.0.1:0",
            "default_max_tokens": 16,
            "grace_seconds": 2,
        },
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return ClusterConfig.from_dict(raw)


def mixed_groups(replicas: int) -> dict[str, Any]:
    return {"mixed": {"replicas": replicas, "resources_per_rank": {"cpu": 0.25}}}


def disaggregated_groups(prefill: int, decode: int, tp: int = 1) -> dict[str, Any]:
    fabric = {"provider": "tcp;ofi_rxm", "node": "127.0.0.1"}
    group = {"tp": tp, "resources_per_rank": {"cpu": 0.25}, "fabric": fabric}
    return {"prefill": {"replicas": prefill, **group}, "decode": {"replicas": decode, **group}}


class ServedCluster:
    def __init__(
        self, config: ClusterConfig, controller_options: Any = None, app_options: Any = None
    ) -> None:
        from orchestrator.control.app import ServingApp

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.app = ServingApp(config, app_options, controller_options=controller_options)
        self.address = self.run(self.app.start(), timeout=300)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.app.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def free_pages(stub: Any, pb: Any) -> list[tuple[str, int, int]]:
    state = stub.GetClusterState(pb.GetClusterStateRequest())
    return [
        (w.worker_id, w.num_free_kv_pages, w.num_total_kv_pages)
        for g in state.groups
        for w in g.workers
    ]


def pools_full(stub: Any, pb: Any, roles: Sequence[str] = ()) -> bool:
    return all(free == total for _, free, total in free_pages(stub, pb))


def blocking_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address)
