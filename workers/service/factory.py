"""The backend of a worker's role (`workers.service.backend.WorkerBackend`).

Its own module, above both kinds of backend: the KV backends build on the contract in
`workers.service.backend`, so choosing among them there would make the two modules import each
other. The KV backends are imported only for their roles: they load the libfabric binding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.engine.config import EngineConfig
from workers.service.backend import MixedBackend, WorkerBackend


def create_backend(
    role: str,
    model_dir: str | Path,
    config: EngineConfig,
    *,
    provider: str = "tcp;ofi_rxm",
    node: str | None = "127.0.0.1",
    transfer: dict[str, Any] | None = None,
    secret: bytes | None = None,
    nics: Sequence[str] = (),
) -> WorkerBackend:
    """``transfer``: `orchestrator.config.sections.TransferConfig` fields, as plain data;
    ``secret``: the cluster's, which authenticates KV control messages (`workers.kv.protocol`);
    ``nics``: a KV worker's NICs, one transfer engine each instead of one on ``node``
    (`workers.service.kv_worker.open_fabric`)."""
    if role == "mixed":
        return MixedBackend(model_dir, config)
    if role == "decode":
        from workers.service.kv_backends import DecodeBackend

        return DecodeBackend(model_dir, config, provider, node, transfer or {}, secret, nics)
    if role == "prefill":
        from workers.service.kv_backends import PrefillBackend

        return PrefillBackend(model_dir, config, provider, node, secret, nics)
    raise ValueError(f"unknown worker role {role!r}")
