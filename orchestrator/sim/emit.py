"""The planner's output: a cluster config (`orchestrator.config.cluster` schema) and Helm values.

Both are plain dicts for `yaml.safe_dump`. `checked_cluster_config` loads the config through
`ClusterConfig.from_dict` before anything is written, so a planned layout is a config the
orchestrator accepts (a `ConfigError` otherwise); `check_options` runs the same loader on the
command's limits and provider before the search, and `check_helm_options` the chart's own
rules (a provider that spans nodes, a model path inside the pods). The Helm values carry the
same layout, limits, KV pools, model path, provider and device, so the same rules cover them.
Every layout runs on the GPUs it reserves (``device: cuda``, one GPU per rank), except one
priced on a machine's shared cores (`CostModel.shared_cores`): its workers run on that
machine's CPUs (``device: cpu``), each rank reserving an equal part of them, and each group
at the CPU priority (``nice``) the plan assumed; the chart gets no values for it (its pods
run on GPU nodes).

KV pools: given the cost model the plan priced, each group gets the pool the simulation
assumed, ``num_pages`` per rank (`kv_num_pages`); without one the engine would fall back to
its small default pool (`workers.engine.config.DEFAULT_KV_MEMORY_BYTES`).

Step settings: the top-level limits are the decode or mixed group's; a prefill group whose
plan gave it a prompt budget of its own carries it in its group's ``limits``, and the group
that decodes its pacing (``min_step_interval_ms``), as the planner searched them
(`planner.RoleLimits`).

Serving options (`options.ServingOptions`): the routing policy goes to both; speculative
decoding (the decode or mixed group's ``speculative``) and prefix caching turned off
(``limits.enable_prefix_caching: false``) to the cluster config only: the chart's worker
groups carry neither. A group that drafts runs without prefix caching (the engine does not
combine them yet), whatever the plan assumed.
"""

from __future__ import annotations

import math
from typing import Any

from orchestrator.config.cluster import ClusterConfig, ConfigError
from orchestrator.config.sections import FABRIC_PROVIDER_ALIASES
from orchestrator.sim.cost import CostModel
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout

PAGE_SIZE = 16  # tokens per KV page of the emitted configs
# The chart's fabric providers (values.schema.json): its pods span nodes, which shm cannot.
HELM_PROVIDERS: tuple[str, ...] = ("efa", "verbs;ofi_rxm", "tcp;ofi_rxm")
# The chart's fabric.rdmaResource for each RDMA provider (its default is EFA's).
RDMA_RESOURCES: dict[str, str] = {"efa": "vpc.amazonaws.com/efa", "verbs;ofi_rxm": "rdma/ib"}


def kv_num_pages(cost: CostModel, tp: int, limits: EngineLimits) -> int:
    """Pages of each rank's KV pool in an instance of ``tp`` ranks, as the plan simulated it
    (``limits.kv_capacity_tokens``, else the cost model's capacity at ``tp``). Every rank holds
    its share of the KV heads for the same pages, so the instance holds ``num_pages *
    PAGE_SIZE`` tokens (`orchestrator.loadgen.validate.limits_of` reads it back so)."""
    tokens = limits.kv_capacity_tokens
    if tokens is None:
        tokens = cost.kv_capacity_tokens(tp)
    num_pages = tokens // PAGE_SIZE
    if num_pages < 1:
        raise ValueError(f"{cost.name} holds {tokens} KV tokens at TP {tp}: not one page")
    return num_pages


def _group(
    replicas: int,
    tp: int,
    provider: str | None,
    limits: dict[str, Any],
    resources: dict[str, Any],
    nice: int = 0,
) -> dict[str, Any]:
    group: dict[str, Any] = {"replicas": replicas, "tp": tp, "resources_per_rank": resources}
    if nice:
        group["nice"] = nice
    if provider is not None:
        group["fabric"] = {"provider": provider}
    if limits:
        group["limits"] = limits
    return group


def _group_limits(
    role: str,
    tp: int,
    limits: EngineLimits,
    prefill_limits: EngineLimits | None,
    cost: CostModel | None,
) -> dict[str, Any]:
    """A group's own limits: the KV pool the plan priced (given ``cost``), a prefill group's
    prompt budget where the plan gave it one of its own, and the pacing of the group that
    decodes (prefill steps are never paced, so the setting would only mislead there)."""
    own: dict[str, Any] = {} if cost is None else {"num_pages": kv_num_pages(cost, tp, limits)}
    if role == "prefill":
        budget = (prefill_limits or limits).max_num_batched_tokens
        if budget != limits.max_num_batched_tokens:
            own["max_num_batched_tokens"] = budget
    elif limits.min_step_interval_s:
        own["min_step_interval_ms"] = limits.min_step_interval_s * 1000
    return own


def cluster_config(
    layout: Layout,
    limits: EngineLimits,
    *,
    cost: CostModel | None = None,
    model_path: str = "/models/model",
    provider: str = "verbs;ofi_rxm",
    dtype: str = "auto",
    options: ServingOptions | None = None,
    pools: bool = True,
    prefill_limits: EngineLimits | None = None,
) -> dict[str, Any]:
    """``limits``: the decode or mixed group's (the config's top-level limits);
    ``prefill_limits``: the prefill group's (default: the same).
    ``cost``: the model the plan priced, whose KV capacity becomes each group's pool (and
    whose shared cores, if any, make a CPU config); None, or ``pools`` False, emits no pool
    (only for checking options: the engine's default pool is not the plan's).
    ``options``: the serving options the plan assumed (see the module docstring)."""
    options = options or ServingOptions()
    shared = None if cost is None else cost.shared_cores
    resources: dict[str, Any] = {"cpu": 4, "gpu": 1}
    if shared is not None:  # every rank an equal part of the machine's cores
        resources = {"cpu": math.floor(100 * shared.cores / layout.num_gpus) / 100 or 0.01}

    def group(role: str, replicas: int, tp: int, fabric: str | None) -> dict[str, Any]:
        own = _group_limits(role, tp, limits, prefill_limits, cost if pools else None)
        nice = 0 if shared is None else shared.nice(role)
        return _group(replicas, tp, fabric, own, dict(resources), nice)

    if layout.is_mixed:
        groups = {"mixed": group("mixed", layout.num_mixed, layout.tp_mixed, None)}
    else:
        groups = {
            "prefill": group("prefill", layout.num_prefill, layout.tp_prefill, provider),
            "decode": group("decode", layout.num_decode, layout.tp_decode, provider),
        }
    spec = options.speculative
    if spec is not None:
        drafting = groups["mixed" if layout.is_mixed else "decode"]
        drafting["speculative"] = {"method": spec.method, "num_speculative_tokens": spec.k}
    config_limits = _config_limits(limits)
    if not options.prefix_caching:
        config_limits["enable_prefix_caching"] = False
    return {
        "model": model_path,
        "dtype": dtype,
        "device": "cuda" if shared is None else "cpu",
        "page_size": PAGE_SIZE,
        "limits": config_limits,
        "groups": groups,
        "router": {"policy": options.routing},
    }


def checked_cluster_config(
    layout: Layout,
    limits: EngineLimits,
    cost: CostModel | None = None,
    *,
    options: ServingOptions | None = None,
    pools: bool = True,
    prefill_limits: EngineLimits | None = None,
    **strings: str,
) -> dict[str, Any]:
    """`cluster_config` (same options), loaded as the orchestrator loads it; `ConfigError` (a
    ValueError) when the loader would refuse it."""
    config = cluster_config(
        layout,
        limits,
        cost=cost,
        options=options,
        pools=pools,
        prefill_limits=prefill_limits,
        **strings,
    )
    ClusterConfig.from_dict(config)
    return config


def check_options(
    limits: EngineLimits,
    *,
    model_path: str,
    provider: str,
    cost: CostModel | None = None,
    prefill_limits: EngineLimits | None = None,
) -> None:
    """Refuse limits or a provider that no emitted config could carry (ConfigError), before
    a search that takes minutes: the loader's own rules on a one-to-one layout, on the device
    the plan's ``cost`` implies (no pools: the model need not fit that layout)."""
    checked_cluster_config(
        Layout(1, 1),
        limits,
        cost,
        pools=False,
        prefill_limits=prefill_limits,
        model_path=model_path,
        provider=provider,
    )


def check_helm_options(*, model_path: str, provider: str) -> str:
    """The chart's provider name for ``provider`` (aliases resolved); ConfigError for a
    provider the chart cannot deploy or a model path that is not absolute inside its pods."""
    canonical = FABRIC_PROVIDER_ALIASES.get(provider, provider)
    if canonical == "shm":
        raise ConfigError(
            "fabric.provider",
            "shm moves KV within one node, and the chart's pods span nodes: use efa or verbs",
        )
    if canonical not in HELM_PROVIDERS:
        raise ConfigError("fabric.provider", f"must be one of {HELM_PROVIDERS}, got {provider!r}")
    if not model_path.startswith("/"):
        raise ConfigError(
            "model.path", f"must be an absolute path inside the chart's pods, got {model_path!r}"
        )
    return canonical


def helm_values(
    layout: Layout,
    limits: EngineLimits,
    *,
    cost: CostModel | None = None,
    model_path: str = "/models/model",
    provider: str = "verbs;ofi_rxm",
    options: ServingOptions | None = None,
    prefill_limits: EngineLimits | None = None,
) -> dict[str, Any] | None:
    """Overrides of `helm/pdserve/values.yaml`; None for a mixed layout (the chart deploys
    prefill and decode groups only). ``cost``, ``options`` and ``prefill_limits`` as in
    `cluster_config` (of the options, the chart carries the routing policy); ConfigError as
    in `check_helm_options`."""
    if cost is not None and cost.shared_cores is not None:
        raise ValueError(
            "a plan on one machine's shared CPU cores: the chart's pods run on GPU nodes"
        )
    if layout.is_mixed:
        return None
    provider = check_helm_options(model_path=model_path, provider=provider)

    def group(role: str, replicas: int, tp: int) -> dict[str, Any]:
        # One RDMA device per GPU (docs/design.md §4: each rank's shard goes out of its own NIC).
        rdma = 0 if provider == "tcp;ofi_rxm" else tp
        values: dict[str, Any] = {
            "replicas": replicas,
            "tpPerPod": tp,
            "gpuPerRank": 1,
            "rdmaDevicesPerPod": rdma,
        }
        own = _group_limits(role, tp, limits, prefill_limits, cost)  # its cluster config's
        if own:
            values["limits"] = own
        return values

    fabric = {"provider": provider}
    if provider in RDMA_RESOURCES:
        fabric["rdmaResource"] = RDMA_RESOURCES[provider]
    return {
        "model": {"path": model_path},
        "fabric": fabric,
        "workerGroups": {
            "prefill": group("prefill", layout.num_prefill, layout.tp_prefill),
            "decode": group("decode", layout.num_decode, layout.tp_decode),
        },
        "clusterConfig": {
            "device": "cuda",
            "page_size": PAGE_SIZE,  # the pages' size, whatever the chart's default
            "limits": _config_limits(limits),
            "router": {"policy": (options or ServingOptions()).routing},
        },
    }


def _config_limits(limits: EngineLimits) -> dict[str, Any]:
    """The top-level ``limits`` of a cluster config (or the chart's ``clusterConfig``) for the
    batch shape the plan assumed (a group's own: `_group_limits`)."""
    return {
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "enable_chunked_prefill": True,
    }
