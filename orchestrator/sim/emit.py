"""The planner's output: a cluster config (`orchestrator.config` schema) and Helm values.

Both are plain dicts for `yaml.safe_dump`. `checked_cluster_config` loads the config through
`ClusterConfig.from_dict` before anything is written, so a planned layout is a config the
orchestrator accepts (a `ConfigError` otherwise); `check_options` runs the same loader on the
command's limits and provider before the search. The Helm values carry the same layout,
limits, provider and device, so the same rules cover them. Every layout runs on the GPUs it
reserves (``device: cuda``, one GPU per rank).
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import ClusterConfig
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.simulator import Layout

PAGE_SIZE = 16  # tokens per KV page of the emitted configs


def _group(replicas: int, tp: int, provider: str | None) -> dict[str, Any]:
    group: dict[str, Any] = {
        "replicas": replicas,
        "tp": tp,
        "resources_per_rank": {"cpu": 4, "gpu": 1},
    }
    if provider is not None:
        group["fabric"] = {"provider": provider}
    return group


def cluster_config(
    layout: Layout,
    limits: EngineLimits,
    *,
    model_path: str = "/models/model",
    provider: str = "verbs;ofi_rxm",
    dtype: str = "auto",
) -> dict[str, Any]:
    if layout.is_mixed:
        groups = {"mixed": _group(layout.num_mixed, layout.tp_mixed, None)}
    else:
        groups = {
            "prefill": _group(layout.num_prefill, layout.tp_prefill, provider),
            "decode": _group(layout.num_decode, layout.tp_decode, provider),
        }
    return {
        "model": model_path,
        "dtype": dtype,
        "device": "cuda",
        "page_size": PAGE_SIZE,
        "limits": {
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
            "enable_chunked_prefill": True,
        },
        "groups": groups,
        "router": {"policy": "least_outstanding"},
    }


def checked_cluster_config(layout: Layout, limits: EngineLimits, **options: str) -> dict[str, Any]:
    """`cluster_config` (same options), loaded as the orchestrator loads it; `ConfigError` (a
    ValueError) when the loader would refuse it."""
    config = cluster_config(layout, limits, **options)
    ClusterConfig.from_dict(config)
    return config


def check_options(limits: EngineLimits, *, model_path: str, provider: str) -> None:
    """Refuse limits or a provider that no emitted config could carry (ConfigError), before
    a search that takes minutes: the loader's own rules on a one-to-one layout."""
    checked_cluster_config(Layout(1, 1), limits, model_path=model_path, provider=provider)


def helm_values(
    layout: Layout, limits: EngineLimits, *, provider: str = "verbs;ofi_rxm"
) -> dict[str, Any] | None:
    """Overrides of `helm/pdserve/values.yaml`; None for a mixed layout (the chart deploys
    prefill and decode groups only)."""
    if layout.is_mixed:
        return None

    def group(replicas: int, tp: int) -> dict[str, Any]:
        # One RDMA device per GPU (DESIGN.md §4: each rank's shard goes out of its own NIC).
        rdma = 0 if provider == "tcp;ofi_rxm" else tp
        return {"replicas": replicas, "tpPerPod": tp, "gpuPerRank": 1, "rdmaDevicesPerPod": rdma}

    return {
        "fabric": {"provider": provider},
        "workerGroups": {
            "prefill": group(layout.num_prefill, layout.tp_prefill),
            "decode": group(layout.num_decode, layout.tp_decode),
        },
        "clusterConfig": {
            "device": "cuda",
            "limits": {
                "max_num_seqs": limits.max_num_seqs,
                "max_num_batched_tokens": limits.max_num_batched_tokens,
                "enable_chunked_prefill": True,
            },
        },
    }
