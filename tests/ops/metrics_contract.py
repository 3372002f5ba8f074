"""The golden metric list (``workers/metrics_contract.json``), shared by the ops tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACT_PATH = REPO / "workers" / "metrics_contract.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class ContractEntry:
    name: str
    type: str
    labels: tuple[str, ...]


def load_contract() -> dict[str, ContractEntry]:
    rows = json.loads(CONTRACT_PATH.read_text())
    return {
        row["name"]: ContractEntry(row["name"], row["type"], tuple(row["labels"])) for row in rows
    }


def family_of(series_name: str, contract: dict[str, ContractEntry]) -> str | None:
    """The contract name a scraped or queried series belongs to (``x_bucket`` -> ``x`` for
    histograms), or None when it is not in the contract."""
    if series_name in contract:
        return series_name
    for suffix in HISTOGRAM_SUFFIXES:
        base = series_name.removesuffix(suffix)
        entry = contract.get(base) if base != series_name else None
        if entry is not None and entry.type == "histogram":
            return base
    return None


# Which roles update each metric family (every process registers every family, so a selector
# on another role finds only flat zeros or nothing). The router's share is what
# `orchestrator/router/core.py` records (role "router", `orchestrator/control/app.py`); the workers' is
# `workers/service/metrics.py`'s `WorkerMetricsExporter.refresh`, which `test_metrics.py`
# and `test_worker_token_metrics.py` check against this table. The token counters mean the
# requests' tokens on the router and the engine's work on a worker; a prefill worker never
# samples, so it does not export generation tokens.
_ROUTER = ("router",)
_KV_ROLES = ("prefill", "decode")
_EVERY_ROLE = ("router", "prefill", "decode", "mixed")
EXPORTED_BY: dict[str, tuple[str, ...]] = {
    "pdserve_time_to_first_token_seconds": _ROUTER,
    "pdserve_inter_token_latency_seconds": _ROUTER,
    "pdserve_e2e_request_latency_seconds": _ROUTER,
    "pdserve_request_queue_time_seconds": _ROUTER,
    "pdserve_num_requests_running": _EVERY_ROLE,
    "pdserve_num_requests_waiting": _EVERY_ROLE,
    "pdserve_prompt_tokens_total": _EVERY_ROLE,
    "pdserve_generation_tokens_total": ("router", "decode", "mixed"),
    # Prefix caching runs on mixed workers only so far.
    "pdserve_prefix_cache_queries_total": ("mixed",),
    "pdserve_prefix_cache_hits_total": ("mixed",),
    # Speculative decoding runs where tokens are sampled.
    "pdserve_spec_decode_num_draft_tokens_total": ("decode", "mixed"),
    "pdserve_spec_decode_num_accepted_tokens_total": ("decode", "mixed"),
    "pdserve_spec_decode_num_accepted_tokens_per_pos_total": ("decode", "mixed"),
    "pdserve_request_success_total": _ROUTER,
    "pdserve_kv_pages_used": ("prefill", "decode", "mixed"),
    "pdserve_kv_pages_capacity": ("prefill", "decode", "mixed"),
    "pdserve_kv_pages_pinned_for_transfer": _KV_ROLES,
    # The prefill side pushes the KV and times it; a decoder's record carries no byte count.
    "pdserve_kv_transfer_seconds": ("prefill",),
    "pdserve_kv_transfer_bytes": ("prefill",),
    "pdserve_kv_transfer_exposed_seconds": ("prefill",),
    "pdserve_kv_transfer_failures_total": _KV_ROLES,
    "pdserve_kv_messenger_queue_depth": _KV_ROLES,
    "pdserve_kv_checksum_failures_total": ("decode",),
    "pdserve_kv_unauthenticated_messages_total": ("prefill", "decode"),
    "pdserve_kv_transfer_pages_total": ("decode",),
    "pdserve_router_decisions_total": _ROUTER,
    "pdserve_router_retries_total": _ROUTER,
    "pdserve_router_prefill_tokens_in_flight": _ROUTER,
    "pdserve_router_prefix_index_blocks": _ROUTER,
    "pdserve_router_prefix_query_tokens_total": _ROUTER,
    "pdserve_router_prefix_hit_tokens_total": _ROUTER,
}
WORKER_ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
