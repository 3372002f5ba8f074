"""The chart's values and their schema: every value documented, the schema generated from the
cluster config's models and current, invalid values refused, rules across values (router ports,
sizes) failing the render."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from types import ModuleType
from typing import Any

import helm_python as helm
import pytest

from orchestrator.config.cluster import GROUP_LIMIT_KEYS, ClusterConfig
from orchestrator.config.sections import (
    FABRIC_PROVIDERS,
    Limits,
    RouterConfig,
    TLSConfig,
    TransferConfig,
)
from tests.ops.helm_chart import (
    CHART,
    EFA,
    RELEASE,
    RENDERED,
    cluster_yaml,
    one,
    render_values,
    with_value,
)
from tests.ops.metrics_contract import REPO

GENERATOR = REPO / "scripts" / "gen_config_schema.py"

# --- values and their schema --------------------------------------------------------------


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z_][\w.-]*:", line):
            continue
        comments = []
        above = number - 1
        while above >= 0 and lines[above].strip().startswith("#"):
            comments.append(lines[above])
            above -= 1
        if not any(c.strip().startswith("# --") for c in comments):
            undocumented.append(f"values.yaml:{number + 1}: {line.strip()}")
    assert undocumented == []


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def test_schema_follows_the_cluster_config() -> None:
    config = _schema()["properties"]["clusterConfig"]["properties"]
    assert set(config["limits"]["properties"]) == set(Limits.model_fields)
    assert set(config["transfer"]["properties"]) == set(TransferConfig.model_fields)
    # address and http_address are the chart's (router.grpcPort / httpPort).
    router = config["router"]["properties"]
    assert set(router) == set(RouterConfig.model_fields) - {"address", "http_address"}
    assert set(router["tls"]["properties"]) == set(TLSConfig.model_fields)
    # The token only as a file: a literal one would sit in the ConfigMap.
    assert set(router["auth"]["properties"]) == {"token_file"}
    group = _schema()["properties"]["workerGroups"]["properties"]["prefill"]
    assert set(group["properties"]["limits"]["properties"]) == set(GROUP_LIMIT_KEYS)


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_schema", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_schema_is_the_generated_one() -> None:
    """values.schema.json is generated: edit its source or the config models, then rerun."""
    assert (CHART / "values.schema.json").read_text() == _generator().render(), (
        "helm/pdserve/values.schema.json is stale: run python scripts/gen_config_schema.py"
    )


def test_generator_check_passes_on_the_committed_schema() -> None:
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_generated_parts_replace_every_marker() -> None:
    text = (CHART / "values.schema.json").read_text()
    assert "$generated" not in text
    provider = _schema()["properties"]["fabric"]["properties"]["provider"]
    assert set(provider["enum"]) == set(FABRIC_PROVIDERS) - {"shm"}
    # The hand-written keys of a marker stay: the chart always renders a router section.
    assert _schema()["properties"]["clusterConfig"]["required"] == ["router"]


def test_defaults_and_combos_pass_the_schema(chart: Any) -> None:
    for values in RENDERED.values():
        chart.validate_schema(values)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"workerGroups": {"decode": {"replicas": -1}}}, "replicas"),
        ({"workerGroups": {"decode": {"replicas": 0}}}, "replicas"),
        ({"workerGroups": {"decode": {"tpPerPod": 0}}}, "tpPerPod"),
        ({"workerGroups": {"decode": {"gpus": 1}}}, "gpus"),
        ({"workerGroups": {"mixed": {"replicas": 1}}}, "mixed"),
        ({"replicaCount": 3}, "replicaCount"),
        ({"fabric": {"provider": "sockets"}}, "provider"),
        ({"fabric": {"provider": "shm"}}, "provider"),
        ({"fabric": {"nics": []}}, "nics"),
        ({"fabric": {"nics": "eth1"}}, "nics"),
        ({"fabric": {"nics": ["net1", "net1"]}}, "nics"),
        ({"clusterConfig": {"page_size": 24}}, "page_size"),
        ({"clusterConfig": {"device": "gpu"}}, "device"),
        ({"clusterConfig": {"limits": {"max_num_seq": 8}}}, "max_num_seq"),
        ({"clusterConfig": {"router": {"address": "0.0.0.0:1"}}}, "address"),
        ({"clusterConfig": {"router": {"policy": "fastest"}}}, "policy"),
        ({"clusterConfig": {"router": {"auth": {"token": "s3cret"}}}}, "token"),
        ({"clusterConfig": {"router": {"tls": {"certificate": "/x.pem"}}}}, "certificate"),
        ({"clusterConfig": {"worker_host": "127.0.0.1"}}, "worker_host"),
        ({"router": {"tls": {"existingSecret": 1}}}, "existingSecret"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"monitoring": {"enabled": "yes"}}, "enabled"),
    ],
)
def test_schema_rejects_invalid_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmError, match=where):
        chart.validate_schema(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workerGroups": {"prefill": {"replicas": 1}, "decode": {"replicas": 17}}}, "1:16"),
        ({"fabric": EFA}, "rdmaDevicesPerPod"),
        (
            {
                "router": {"tls": {"existingSecret": "router-tls"}},
                "clusterConfig": {"router": {"tls": {"cert": "/c.pem", "key": "/k.pem"}}},
            },
            "give one or the other",
        ),
        ({"router": {"tls": {"verifyClients": True}}}, "verifyClients"),
    ],
)
def test_rules_across_values_fail_the_render(
    chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE)


# --- 1. router ports ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ports",
    [
        {"grpcPort": 8000, "httpPort": 8000},
        {"httpPort": 9400, "metricsPort": 9400},
        {"grpcPort": 9400, "metricsPort": 9400},
    ],
)
def test_router_ports_must_differ(chart: Any, ports: dict[str, int]) -> None:
    with pytest.raises(helm.HelmError, match="the router's ports must differ"):
        chart.render({"router": ports}, name=RELEASE)


@pytest.mark.parametrize(
    ("key", "port"),
    [
        ("grpcPort", 6379),
        ("httpPort", 8265),
        ("metricsPort", 10001),
        ("metricsPort", 8080),
        ("grpcPort", 52365),
    ],
)
def test_router_ports_avoid_rays_own(chart: Any, key: str, port: int) -> None:
    with pytest.raises(helm.HelmError, match=rf"router\.{key}: {port} is the Ray .* port"):
        chart.render({"router": {key: port}}, name=RELEASE)


def test_worker_metrics_port_avoids_rays_own(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match=r"workerMetricsPort: 8080 is the Ray metrics"):
        chart.render({"workerMetricsPort": 8080}, name=RELEASE)


def test_distinct_router_ports_render_a_valid_service(chart: Any) -> None:
    ports = {"grpcPort": 9000, "httpPort": 9001, "metricsPort": 9002}
    docs = render_values(chart, {"router": ports})
    service = one(docs, "Service", "demo-pdserve-router")
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [9000, 9001, 9002]
    config = ClusterConfig.from_dict(cluster_yaml(docs))
    assert (config.router.port, config.router.http_host_port) == (9000, ("0.0.0.0", 9001))


@pytest.mark.parametrize(
    "values",
    [
        with_value("clusterConfig.router.max_request_bytes", "0B"),
        with_value("clusterConfig.limits.kv_memory_bytes", "0GiB"),
        with_value("workerGroups.prefill.limits.kv_memory_bytes", "000"),
        with_value("head.cpu", "0"),
        with_value("head.cpu", "0m"),
        with_value("head.memory", "0"),
        with_value("head.memory", "0.0Gi"),
        with_value("workerGroups.decode.memory", "0Gi"),
    ],
)
def test_schema_refuses_zero_sizes(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        chart.validate_schema(values)


@pytest.mark.parametrize(
    "values",
    [
        with_value("head.cpu", "500m"),
        with_value("head.cpu", "0.5"),
        with_value("head.memory", "10Gi"),
    ],
)
def test_schema_takes_small_nonzero_quantities(chart: Any, values: dict[str, Any]) -> None:
    chart.validate_schema(values)
