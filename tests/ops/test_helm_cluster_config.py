"""The cluster config the chart writes: one `orchestrator.config.cluster` accepts, matching the
values; router TLS and token from mounted Secrets; the CUDA rules and byte sizes judged as the
orchestrator judges them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from orchestrator.config.cluster import ClusterConfig, ConfigError
from orchestrator.config.sections import Limits
from tests.ops.helm_chart import (
    COMBOS,
    EFA_GPU,
    RELEASE,
    cluster_yaml,
    default_values,
    head_spec,
    merge_values,
    render,
    render_values,
    with_value,
)
from tests.orchestrator.config.config_helpers import TINY_SHAPE, write_model

# --- the cluster config ----------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_cluster_config_parses_and_matches_values(combo: str, tmp_path: Path) -> None:
    values = merge_values(default_values(), COMBOS[combo])
    raw = cluster_yaml(render(combo))
    # The model rules (TP against the KV heads) need a config.json; the tiny preset's 2 KV heads
    # take TP 1 and 2.
    raw["model"] = str(write_model(tmp_path / "model", **TINY_SHAPE))
    config = ClusterConfig.from_dict(raw)
    assert config.is_disaggregated
    for role in ("prefill", "decode"):
        group, wanted = config.group(role), values["workerGroups"][role]
        assert (group.replicas, group.tp) == (wanted["replicas"], wanted["tpPerPod"])
        assert group.threads == wanted["cpuPerRank"]  # a rank uses the CPUs it requests
        assert group.fabric is not None and group.fabric.provider == values["fabric"]["provider"]
        assert group.resources_per_rank.bundle() == {
            "CPU": wanted["cpuPerRank"],
            **({"GPU": wanted["gpuPerRank"]} if wanted["gpuPerRank"] else {}),
            f"pdserve_{role}": 1,
        }
    assert config.router.address == "0.0.0.0:50051"
    assert config.router.policy == values["clusterConfig"]["router"]["policy"]


@pytest.mark.parametrize("combo", COMBOS)
def test_workers_listen_on_every_interface_of_their_pod(combo: str) -> None:
    """The router on the head pod dials workers on other pods, and the PodMonitor scrapes
    them at their pod IP: workers bind 0.0.0.0 and advertise their node IP
    (`workers.service.actor.advertised_address`); libfabric picks the pod's NIC."""
    config = ClusterConfig.from_dict(cluster_yaml(render(combo)))
    assert config.worker_host == "0.0.0.0"
    for role in ("prefill", "decode"):
        fabric = config.group(role).fabric
        assert fabric is not None and fabric.node is None


def test_fabric_nics_reach_both_groups(chart: Any) -> None:
    """`fabric.nics` lists the pod interfaces each worker opens an engine on; `auto` (the
    default) leaves the key out, one engine on the interface libfabric picks."""
    assert "nics" not in cluster_yaml(render("1p3d-cpu"))["groups"]["decode"]["fabric"]
    docs = render_values(chart, with_value("fabric.nics", ["net1", "net2"]))
    config = ClusterConfig.from_dict(cluster_yaml(docs))
    for role in ("prefill", "decode"):
        fabric = config.group(role).fabric
        assert fabric is not None and fabric.nic_entries == ("net1", "net2")


def test_router_tls_and_token_come_from_mounted_secrets(tmp_path: Path) -> None:
    docs = render("router-tls-token")
    raw = cluster_yaml(docs)
    assert raw["router"]["tls"] == {
        "cert": "/etc/pdserve-router/tls/tls.crt",
        "key": "/etc/pdserve-router/tls/tls.key",
        "ca": "/etc/pdserve-router/tls/ca.crt",
    }
    assert raw["router"]["auth"] == {"token_file": "/etc/pdserve-router/auth/token"}
    head = head_spec(docs)
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["router-tls"]["secret"] == {"secretName": "router-tls"}
    assert volumes["router-auth"]["secret"] == {"secretName": "router-token"}
    mounts = {m["name"]: m for m in head["containers"][0]["volumeMounts"]}
    assert mounts["router-tls"] == {
        "name": "router-tls",
        "mountPath": "/etc/pdserve-router/tls",
        "readOnly": True,
    }
    assert mounts["router-auth"]["mountPath"] == "/etc/pdserve-router/auth"
    # The orchestrator reads what the Secrets hold once mounted: here, files in their place.
    (tmp_path / "token").write_text("s3cret\n")
    raw["router"]["auth"]["token_file"] = str(tmp_path / "token")
    config = ClusterConfig.from_dict(raw)
    assert config.router.auth.token == "s3cret"
    assert config.router.tls.enabled and config.router.tls.ca is not None
    # Neither the token nor a key is in any rendered manifest.
    assert "s3cret" not in json.dumps(docs)


def test_router_is_plaintext_without_secrets() -> None:
    docs = render("1p3d-cpu")
    config = ClusterConfig.from_dict(cluster_yaml(docs))
    assert not config.router.tls.enabled and config.router.auth.token is None
    names = {v["name"] for v in head_spec(docs)["volumes"]}
    assert not names & {"router-tls", "router-auth"}


def test_cluster_config_without_the_model_checks_schema_only() -> None:
    # /models/model is absent here: the model rules are skipped, the schema is still checked.
    config = ClusterConfig.from_dict(cluster_yaml(render("1p3d-cpu")))
    assert str(config.model) == "/models/model"
    assert config.group("decode").limits == Limits()


def test_group_limits_reach_the_cluster_config() -> None:
    raw = cluster_yaml(render("1p1d-verbs-authoptions"))
    config = ClusterConfig.from_dict(raw)
    assert config.group("prefill").limits.num_pages == 512
    assert config.group("decode").limits.num_pages is None


# --- 2. the CUDA rules --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            # An RDMA provider, but no GPUs (the default gpuPerRank 0).
            {
                "clusterConfig": {"device": "cuda"},
                "fabric": EFA_GPU["fabric"],
                "workerGroups": {
                    "prefill": {"rdmaDevicesPerPod": 1},
                    "decode": {"rdmaDevicesPerPod": 1},
                },
            },
            r"workerGroups\.decode\.gpuPerRank: clusterConfig\.device cuda runs",
        ),
        (
            with_value(
                "workerGroups.prefill.gpuPerRank",
                0,
                with_value("clusterConfig.device", "cuda:1", EFA_GPU),
            ),
            r"workerGroups\.prefill\.gpuPerRank: clusterConfig\.device cuda:1 runs",
        ),
        (
            {
                "clusterConfig": {"device": "cuda"},
                "workerGroups": {"prefill": {"gpuPerRank": 1}, "decode": {"gpuPerRank": 1}},
            },
            r"fabric\.provider: tcp;ofi_rxm cannot register GPU memory",
        ),
        (
            # auto runs on the GPU a rank reserves: the same rule as cuda
            # (orchestrator/config/cluster.py).
            {"clusterConfig": {"device": "auto"}, "workerGroups": {"decode": {"gpuPerRank": 1}}},
            r"fabric\.provider: tcp;ofi_rxm cannot register GPU memory .*auto",
        ),
    ],
)
def test_cuda_device_needs_gpus_and_a_gpu_memory_provider(
    chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE)


@pytest.mark.parametrize(
    "values",
    [
        with_value("clusterConfig.device", "cuda", EFA_GPU),
        with_value("clusterConfig.device", "auto", EFA_GPU),
        with_value("clusterConfig.device", "auto"),  # no GPUs: auto is cpu, tcp is fine
        {"workerGroups": {"decode": {"gpuPerRank": 1}}},  # device cpu leaves KV in host memory
    ],
)
def test_cuda_rules_pass_what_the_orchestrator_takes(chart: Any, values: dict[str, Any]) -> None:
    config = ClusterConfig.from_dict(cluster_yaml(render_values(chart, values)))
    assert config.device == values.get("clusterConfig", {}).get("device", "cpu")


# --- 3. byte sizes and quantities ---------------------------------------------------------


def _python_accepts(key: str, size: str, raw: dict[str, Any]) -> bool:
    raw = with_value(key, size, raw)
    try:
        ClusterConfig.from_dict(raw)
    except ConfigError:
        return False
    return True


SIZES = [
    # (size, accepted as router.max_request_bytes, accepted as kv_memory_bytes)
    ("4MiB", True, True),
    ("1KiB", True, True),
    ("1GiB", True, True),
    ("1 GB", True, True),
    ("2GiB", False, True),
    ("1.5GiB", False, True),
    ("1000B", False, True),
    ("0.5KiB", False, True),
    ("0.5B", False, False),
    ("0B", False, False),
    ("0", False, False),
    ("0.0GiB", False, False),
]


@pytest.mark.parametrize(("size", "as_request", "as_kv"), SIZES)
def test_sizes_pass_the_chart_as_they_pass_the_orchestrator(
    chart: Any, size: str, as_request: bool, as_kv: bool
) -> None:
    raw = cluster_yaml(render_values(chart, {}))
    cases = [
        ("clusterConfig.router.max_request_bytes", "router.max_request_bytes", as_request),
        ("clusterConfig.limits.kv_memory_bytes", "limits.kv_memory_bytes", as_kv),
        (
            "workerGroups.decode.limits.kv_memory_bytes",
            "groups.decode.limits.kv_memory_bytes",
            as_kv,
        ),
    ]
    for value_key, config_key, accepted in cases:
        assert _python_accepts(config_key, size, raw) == accepted, (config_key, size)
        values = with_value(value_key, size)
        if accepted:
            render_values(chart, values)
        else:
            with pytest.raises(helm.HelmError, match=value_key.rpartition(".")[2]):
                render_values(chart, values)
