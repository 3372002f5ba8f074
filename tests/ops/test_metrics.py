"""The metrics contract: what `workers.metrics` registers equals the golden list, and a live
scrape of ``/metrics`` passes ``promtool check metrics`` and parses back."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.metrics_contract import EXPORTED_BY, WORKER_ROLES, family_of, load_contract
from workers.engine.sequence import FinishReason
from workers.kv.transfer_state import DecodeState, PrefillState
from workers.metrics import BASE_LABELS, LABEL_VALUES, METRIC_SPECS, Metrics, serve_metrics
from workers.service.metrics import WorkerMetricsExporter

# prometheus_client adds a `<name>_created` timestamp series to counters and histograms; it is
# the library's bookkeeping, not part of our contract.
CREATED = "_created"


def _registered(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposition name -> (type, label names) of every family on ``registry``."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        labels: set[str] = set()
        for sample in family.samples:
            labels.update(key for key in sample.labels if key != "le")
        found[name] = (family.type, tuple(sorted(labels)))
    return found


def test_registry_equals_golden_list() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, role="router", model="m")
    # The two per-worker metrics have no up-front series (worker ids are not known in advance).
    metrics.count_router_decision("decode-0")
    metrics.set_prefill_tokens_in_flight("prefill-0", 0)
    contract = load_contract()
    expected = {name: (entry.type, tuple(sorted(entry.labels))) for name, entry in contract.items()}
    assert _registered(registry) == expected


def test_specs_equal_golden_list_in_order() -> None:
    contract = load_contract()
    assert [spec.name for spec in METRIC_SPECS] == list(contract)
    for spec in METRIC_SPECS:
        assert spec.kind == contract[spec.name].type
        assert spec.label_names == contract[spec.name].labels


def test_names_follow_prometheus_conventions() -> None:
    for entry in load_contract().values():
        assert re.fullmatch(r"pdserve_[a-z0-9_]+", entry.name), entry.name
        assert entry.name.endswith("_total") == (entry.type == "counter"), entry.name
        assert entry.labels[: len(BASE_LABELS)] == BASE_LABELS, entry.name
        if entry.type == "histogram":
            assert entry.name.endswith(("_seconds", "_bytes")), entry.name


def test_no_label_names_a_request() -> None:
    for entry in load_contract().values():
        for label in entry.labels:
            assert not re.search(r"request|req_id|rid|uuid|trace", label), (entry.name, label)


def test_vocabularies_follow_the_engine_and_messenger() -> None:
    # A rename in the engine or the messenger must show up here, not as an unknown label value
    # raised from a hot path.
    assert set(LABEL_VALUES["finished_reason"]) == {r.value for r in FinishReason} - {"prefilled"}
    live_states = {s.value for s in DecodeState} - {"ready", "failed"}
    live_states |= {s.value for s in PrefillState} - {"done", "cancelled", "failed"}
    assert set(LABEL_VALUES["queue"]) == live_states


def test_closed_vocabularies_reject_unknown_values() -> None:
    metrics = Metrics(CollectorRegistry(), role="decode", model="m")
    with pytest.raises(ValueError, match="finished_reason"):
        metrics.count_request_success("req-42")
    with pytest.raises(ValueError, match="reason"):
        metrics.count_transfer_failure("oops")
    with pytest.raises(ValueError, match="queue"):
        metrics.set_queue_depth("elsewhere", 1)
    with pytest.raises(ValueError, match="kind"):
        metrics.count_router_retry("decode-0")
    with pytest.raises(ValueError, match="role"):
        Metrics(CollectorRegistry(), role="gateway", model="m")


def test_two_workers_share_no_registry() -> None:
    # In-process workers each own a registry; a second one on the same registry is refused.
    registry = CollectorRegistry()
    Metrics(registry, role="prefill", model="m")
    Metrics(CollectorRegistry(), role="prefill", model="m")
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry, role="decode", model="m")


@pytest.fixture
def served() -> Iterator[tuple[Metrics, int]]:
    registry = CollectorRegistry()
    metrics = Metrics(registry, role="decode", model="smol")
    server, port = serve_metrics(registry, host="127.0.0.1", port=0)
    try:
        yield metrics, port
    finally:
        server.shutdown()
        server.server_close()


def _observe_everything(metrics: Metrics) -> None:
    metrics.time_to_first_token.observe(0.12)
    metrics.inter_token_latency.observe(0.004)
    metrics.e2e_request_latency.observe(3.5)
    metrics.request_queue_time.observe(0.02)
    metrics.num_requests_running.set(3)
    metrics.num_requests_waiting.set(1)
    metrics.prompt_tokens.inc(512)
    metrics.generation_tokens.inc(64)
    metrics.count_request_success("stop")
    metrics.kv_pages_used.set(40)
    metrics.kv_pages_capacity.set(384)
    metrics.kv_pages_pinned_for_transfer.set(8)
    metrics.kv_transfer_seconds.observe(0.08)
    metrics.kv_transfer_bytes.observe(3 * 2**20)
    metrics.kv_transfer_exposed_seconds.observe(0.01)
    metrics.count_transfer_failure("deadline")
    metrics.set_queue_depth("requested", 2)
    metrics.count_router_decision("decode-1")
    metrics.count_router_retry("worker")
    metrics.set_prefill_tokens_in_flight("prefill-0", 300)
    metrics.count_router_prefix_lookup(64, 48)
    metrics.router_prefix_index_blocks.set(12)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        body: bytes = response.read()
    return body.decode()


def test_live_scrape_parses_back_with_every_value(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    _observe_everything(metrics)
    contract = load_contract()
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(_scrape(port)):
        if family.name.endswith(CREATED):
            continue
        for sample in family.samples:
            if sample.name.endswith(CREATED):
                continue
            base = family_of(sample.name, contract)
            assert base is not None, f"{sample.name} is not in the contract"
            assert sample.labels["role"] == "decode" and sample.labels["model"] == "smol"
            seen[sample.name] = seen.get(sample.name, 0.0) + sample.value
    assert {family_of(name, contract) for name in seen} == set(contract)
    assert seen["pdserve_prompt_tokens_total"] == 512
    assert seen["pdserve_kv_pages_capacity"] == 384
    assert seen["pdserve_kv_transfer_bytes_count"] == 1
    assert seen["pdserve_kv_transfer_bytes_sum"] == 3 * 2**20
    assert seen["pdserve_request_success_total"] == 1  # zero-valued series for other reasons
    assert seen["pdserve_router_decisions_total"] == 1
    assert seen["pdserve_router_retries_total"] == 1  # zero-valued series for "prefill"
    assert seen["pdserve_router_prefill_tokens_in_flight"] == 300
    assert seen["pdserve_router_prefix_query_tokens_total"] == 64
    assert seen["pdserve_router_prefix_hit_tokens_total"] == 48
    assert seen["pdserve_router_prefix_index_blocks"] == 12


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install --no-install-recommends prometheus)",
)


def _promtool(text: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


@needs_promtool
def test_live_scrape_passes_promtool(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    _observe_everything(metrics)
    result = _promtool(_scrape(port))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


@needs_promtool
def test_promtool_does_lint() -> None:
    # Guards the check above: promtool must flag what our conventions forbid.
    bad = "# HELP kv_pages_total Pages.\n# TYPE kv_pages_total gauge\nkv_pages_total 1\n"
    result = _promtool(bad)
    assert result.returncode != 0
    assert "_total" in result.stdout + result.stderr


class _FakeKVWorker:
    """`workers.service.kv_worker` as the exporter reads it: state and finished transfers."""

    def state(self) -> dict[str, object]:
        return {"num_pinned_pages": 3, "transfers_by_state": {"writing": 2}}

    def finished_transfers(self) -> dict[str, dict[str, object]]:
        return {
            "ok": {
                "state": "done",
                "num_bytes": 65536,
                "first_submit_s": 1.0,
                "last_completion_s": 1.5,
                "forward_end_s": 1.4,
            },
            "bad": {"state": "failed", "reason": "deadline", "checksum_mismatch": True},
        }


class _FakeBackend:
    def __init__(self) -> None:
        self.worker = _FakeKVWorker()

    def load(self) -> SimpleNamespace:
        return SimpleNamespace(
            num_running_requests=2,
            num_waiting_requests=1,
            num_total_kv_pages=64,
            num_free_kv_pages=60,
            num_computed_prompt_tokens=40,
            num_sampled_tokens=5,
            num_prefix_cache_queries=48,
            num_prefix_cache_hits=32,
            num_spec_draft_tokens=30,
            num_spec_accepted_tokens=12,
            num_spec_accepted_per_pos=(8, 4),
            num_unauthenticated_messages=1,
            num_kv_pages_written=6,
            num_kv_pages_skipped=2,
        )


def _updated_families(registry: CollectorRegistry) -> set[str]:
    """Contract families with a non-zero sample (a histogram: a non-zero ``_count``)."""
    contract = load_contract()
    updated: set[str] = set()
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_sum", CREATED)) or not sample.value:
                continue
            name = family_of(sample.name, contract)
            if name is not None:
                updated.add(name)
    return updated


def test_worker_exporter_updates_what_exported_by_says() -> None:
    """The worker side of `EXPORTED_BY` (what dashboards may select with a worker role) is
    what a worker's exporter really sets, given a backend where everything happened."""
    exporter = WorkerMetricsExporter(_FakeBackend(), "prefill", "/models/smol")
    exporter.refresh()
    worker_families = {
        name for name, roles in EXPORTED_BY.items() if set(roles) & set(WORKER_ROLES)
    }
    assert _updated_families(exporter.registry) == worker_families
