"""Rendering the Helm chart in tests: the main value combinations, the documents they render,
and the cluster config the chart writes."""

from __future__ import annotations

import copy
import functools
from typing import Any

import helm_python as helm
import yaml

from tests.ops.metrics_contract import REPO

CHART = REPO / "helm" / "pdserve"
KUBERNETES_VERSION = "1.30"  # the oldest minor we support (Chart.yaml kubeVersion is >= 1.26)
RELEASE, NAMESPACE = "demo", "serving"
FULLNAME = "demo-pdserve"

# The main value combinations: P:D ratio, GPU or CPU, RDMA on or off, monitoring on or off.
EFA = {"provider": "efa", "rdmaResource": "vpc.amazonaws.com/efa"}
COMBOS: dict[str, dict[str, Any]] = {
    "1p3d-cpu": {},
    "2p2d-gpu-tp2": {
        "workerGroups": {
            "prefill": {"replicas": 2, "tpPerPod": 2, "gpuPerRank": 1},
            "decode": {"replicas": 2, "tpPerPod": 2, "gpuPerRank": 1},
        }
    },
    "1p3d-gpu-efa-monitoring": {
        "fabric": EFA,
        "monitoring": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "workerGroups": {
            "prefill": {"gpuPerRank": 1, "rdmaDevicesPerPod": 4},
            "decode": {"gpuPerRank": 1, "rdmaDevicesPerPod": 1},
        },
    },
    "1p1d-verbs-authoptions": {
        "fabric": {"provider": "verbs;ofi_rxm", "rdmaResource": "rdma/ib"},
        "ray": {"auth": {"useAuthOptions": True}},
        "workerGroups": {
            "prefill": {"replicas": 1, "rdmaDevicesPerPod": 1, "limits": {"num_pages": 512}},
            "decode": {"replicas": 1, "rdmaDevicesPerPod": 1},
        },
        "model": {"volume": {"persistentVolumeClaim": {"claimName": "models"}}},
    },
    "no-auth-no-launcher-no-dashboards": {
        "ray": {"auth": {"enabled": False}},
        "launcher": {"enabled": False},
        "dashboards": {"enabled": False},
    },
}

# Rendered and validated like the combos, but its cluster config names a token file that exists
# only in the head pod, so the tests that parse every combo's config leave it out.
ROUTER_SECRETS: dict[str, Any] = {
    "router": {
        "tls": {"existingSecret": "router-tls", "verifyClients": True},
        "auth": {"existingSecret": "router-token"},
    },
}
RENDERED = {**COMBOS, "router-tls-token": ROUTER_SECRETS}


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = value
    return merged


@functools.cache
def _rendered(combo: str) -> tuple[dict[str, Any], ...]:
    with helm.Chart.load(str(CHART)) as loaded:
        manifests = loaded.render(RENDERED[combo], name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return tuple(docs)


def render(combo: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_rendered(combo)))


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = one(docs, "RayCluster")
    return {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}


def cluster_yaml(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = one(docs, "ConfigMap", f"{FULLNAME}-cluster-config")
    raw: dict[str, Any] = yaml.safe_load(config_map["data"]["cluster.yaml"])
    return raw


def render_values(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def with_value(path: str, value: object, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (or {}) with the dotted ``path`` set to ``value``."""
    values: dict[str, Any] = yaml.safe_load(yaml.safe_dump(base or {}))
    node = values
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return values


def first_container(group: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = group["template"]["spec"]["containers"][0]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var for var in container.get("env", [])}


def head_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    return spec


def default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


EFA_GPU: dict[str, Any] = {
    "fabric": {"provider": "efa", "rdmaResource": "vpc.amazonaws.com/efa"},
    "workerGroups": {
        "prefill": {"gpuPerRank": 1, "rdmaDevicesPerPod": 1},
        "decode": {"gpuPerRank": 1, "rdmaDevicesPerPod": 1},
    },
}
