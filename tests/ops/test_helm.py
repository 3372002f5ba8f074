"""The Helm chart: lint, render for the main value combinations, validate what it renders, and
check that the cluster config it writes is one `orchestrator.config` accepts."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.config import GROUP_LIMIT_KEYS, ClusterConfig
from orchestrator.config_sections import Limits, RouterConfig, TLSConfig, TransferConfig
from tests.ops.crd_schemas import CUSTOM_SCHEMAS
from tests.ops.metrics_contract import REPO
from tests.orchestrator.test_config import TINY_SHAPE, write_model

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


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


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


# --- lint and validation --------------------------------------------------------------------


@pytest.mark.parametrize("combo", ["1p3d-cpu", "1p3d-gpu-efa-monitoring", "router-tls-token"])
def test_lint_is_clean(combo: str) -> None:
    report = helm.lint(str(CHART), RENDERED[combo], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is information ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def _validate_builtin(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _validate_pod_template(template: dict[str, Any], where: str) -> None:
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where}}
    try:
        _validate_builtin({**wrapper, "template": template})
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{where}: {exc.message} at {list(exc.absolute_path)}") from None


@pytest.mark.parametrize("combo", RENDERED)
def test_rendered_manifests_validate(combo: str) -> None:
    for doc in render(combo):
        key = (doc["apiVersion"], doc["kind"])
        if key in CUSTOM_SCHEMAS:
            jsonschema.validate(doc, CUSTOM_SCHEMAS[key])
        else:
            _validate_builtin(doc)
        if doc["kind"] == "RayCluster":
            spec = doc["spec"]
            _validate_pod_template(spec["headGroupSpec"]["template"], "head")
            for group in spec["workerGroupSpecs"]:
                _validate_pod_template(group["template"], group["groupName"])


def test_structural_schemas_catch_mistakes() -> None:
    # The vendored schemas must be able to fail: a number in rayStartParams and a misspelt
    # field are what KubeRay would refuse or silently drop.
    cluster = one(render("1p3d-cpu"), "RayCluster")
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, CUSTOM_SCHEMAS[("ray.io/v1", "RayCluster")])
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpec"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, CUSTOM_SCHEMAS[("ray.io/v1", "RayCluster")])
    head = copy.deepcopy(cluster["spec"]["headGroupSpec"]["template"])
    head["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(AssertionError, match="resource"):
        _validate_pod_template(head, "head")


# --- the cluster config ----------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_cluster_config_parses_and_matches_values(combo: str, tmp_path: Path) -> None:
    values = _merge(_default_values(), COMBOS[combo])
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
    (`orchestrator.worker_actor.advertised_address`); libfabric picks the pod's NIC."""
    config = ClusterConfig.from_dict(cluster_yaml(render(combo)))
    assert config.worker_host == "0.0.0.0"
    for role in ("prefill", "decode"):
        fabric = config.group(role).fabric
        assert fabric is not None and fabric.node is None


def _head(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    return spec


def test_router_tls_and_token_come_from_mounted_secrets(tmp_path: Path) -> None:
    docs = render("router-tls-token")
    raw = cluster_yaml(docs)
    assert raw["router"]["tls"] == {
        "cert": "/etc/pdserve-router/tls/tls.crt",
        "key": "/etc/pdserve-router/tls/tls.key",
        "ca": "/etc/pdserve-router/tls/ca.crt",
    }
    assert raw["router"]["auth"] == {"token_file": "/etc/pdserve-router/auth/token"}
    head = _head(docs)
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
    names = {v["name"] for v in _head(docs)["volumes"]}
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


# --- what the combinations render ---------------------------------------------------------


def _container(group: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = group["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("combo", COMBOS)
def test_replicas_are_the_ratio_and_resources_follow_values(combo: str) -> None:
    values = _merge(_default_values(), COMBOS[combo])
    rendered = groups(render(combo))
    assert set(rendered) == {"prefill", "decode"}
    for role, group in rendered.items():
        wanted = values["workerGroups"][role]
        assert (
            group["replicas"] == group["minReplicas"] == group["maxReplicas"] == wanted["replicas"]
        )
        limits = _container(group)["resources"]["limits"]
        assert _container(group)["resources"]["requests"] == limits
        ranks = wanted["tpPerPod"]
        assert limits["cpu"] == str(ranks * wanted["cpuPerRank"])
        assert group["rayStartParams"]["num-cpus"] == limits["cpu"]
        gpus = ranks * wanted["gpuPerRank"]
        assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        rdma = values["fabric"]["rdmaResource"]
        devices = wanted["rdmaDevicesPerPod"]
        assert limits.get(rdma) == (str(devices) if devices else None)
        assert set(limits) - {"cpu", "memory", "nvidia.com/gpu", rdma} == set()
        # The custom resource that pins the group's ranks, in KubeRay's twice-quoted JSON.
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {
            f"pdserve_{role}": ranks
        }


def test_cpu_combo_asks_for_no_gpu_or_rdma_device() -> None:
    for group in groups(render("1p3d-cpu")).values():
        assert set(_container(group)["resources"]["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("combo", COMBOS)
def test_worker_pods_have_ipc_lock_and_shm(combo: str) -> None:
    for role, group in groups(render(combo)).items():
        container = _container(group)
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"], role
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "4Gi"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_ipc_lock_can_be_turned_off(chart: Any) -> None:
    values = {"workerGroups": {"decode": {"ipcLock": False}}}
    docs = [
        d
        for d in yaml.safe_load_all(
            chart.render(values, name=RELEASE)["pdserve/templates/raycluster.yaml"]
        )
        if d
    ]
    assert "securityContext" not in _container(groups(docs)["decode"])
    assert "securityContext" in _container(groups(docs)["prefill"])


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var for var in container.get("env", [])}


def test_ray_token_auth_is_on_by_default() -> None:
    docs = render("1p3d-cpu")
    secret = one(docs, "Secret", f"{FULLNAME}-ray-auth")
    assert len(secret["data"]["auth_token"]) >= 48
    cluster = one(docs, "RayCluster")
    job = one(docs, "Job")
    containers = [cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [_container(g) for g in cluster["spec"]["workerGroupSpecs"]]
    containers += [job["spec"]["template"]["spec"]["containers"][0]]
    for container in containers:
        env = _env(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULLNAME}-ray-auth", "key": "auth_token"}
    assert "authOptions" not in cluster["spec"]


def test_auth_options_let_kuberay_wire_the_token() -> None:
    docs = render("1p1d-verbs-authoptions")
    cluster = one(docs, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": f"{FULLNAME}-ray-auth"}
    assert "RAY_AUTH_MODE" not in _env(_container(groups(docs)["decode"]))
    # The launcher is no Ray container: KubeRay does not inject its env.
    job_env = _env(one(docs, "Job")["spec"]["template"]["spec"]["containers"][0])
    assert job_env["RAY_AUTH_MODE"]["value"] == "token"


def test_auth_can_be_turned_off() -> None:
    docs = render("no-auth-no-launcher-no-dashboards")
    assert not [d for d in docs if d["kind"] in ("Secret", "Job")]
    for group in groups(docs).values():
        assert "RAY_AUTH_MODE" not in _env(_container(group))


@pytest.mark.parametrize(
    ("combo", "enabled"), [("1p3d-cpu", False), ("1p3d-gpu-efa-monitoring", True)]
)
def test_monitoring_on_and_off(combo: str, enabled: bool) -> None:
    docs = render(combo)
    kinds = {d["kind"] for d in docs}
    assert ({"ServiceMonitor", "PodMonitor"} <= kinds) == enabled
    assert not ({"ServiceMonitor", "PodMonitor"} & kinds) or enabled
    if enabled:
        service = one(docs, "Service", f"{FULLNAME}-router")
        monitor = one(docs, "ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= service["metadata"]["labels"].items()
        )
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        pod_monitor = one(docs, "PodMonitor")
        selected = pod_monitor["spec"]["selector"]["matchExpressions"][0]["values"]
        assert selected == ["decode", "prefill"]
        for group in groups(docs).values():
            labels = group["template"]["metadata"]["labels"]
            assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert any(p["name"] == "metrics" for p in _container(group)["ports"])


def test_router_service_points_at_the_head() -> None:
    docs = render("1p3d-cpu")
    service = one(docs, "Service", f"{FULLNAME}-router")
    assert service["spec"]["selector"] == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    for port in service["spec"]["ports"]:
        assert port["name"] in ("grpc", "http", "metrics")
        assert head_ports[port["targetPort"]] == port["port"]


def test_launcher_submits_the_rendered_config() -> None:
    docs = render("1p3d-cpu")
    job = one(docs, "Job")
    assert "post-install" in job["metadata"]["annotations"]["helm.sh/hook"]
    pod = job["spec"]["template"]["spec"]
    script = pod["containers"][0]["args"][0]
    assert re.search(r"ray job submit .*--working-dir /etc/pdserve", script.replace("\\\n", ""))
    assert "python -m orchestrator.launch cluster.yaml" in script
    assert pod["volumes"][0]["configMap"]["name"] == f"{FULLNAME}-cluster-config"
    env = _env(pod["containers"][0])
    assert env["RAY_ADDRESS"]["value"] == f"http://{FULLNAME}-head-svc.{NAMESPACE}.svc:8265"


def test_dashboards_ship_as_configmaps() -> None:
    chart_copy = CHART / "dashboards" / "pdserve.json"
    # Helm cannot read outside the chart: its copy must be the repository's dashboard, byte
    # for byte.
    assert chart_copy.read_bytes() == (REPO / "dashboards" / "pdserve.json").read_bytes()
    assert sorted(p.name for p in (CHART / "dashboards").iterdir()) == sorted(
        p.name for p in (REPO / "dashboards").glob("*.json")
    )
    config_map = one(render("1p3d-cpu"), "ConfigMap", f"{FULLNAME}-dashboard-pdserve")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["pdserve.json"]) == json.loads(chart_copy.read_text())


# --- values and their schema --------------------------------------------------------------


def _default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


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
    assert set(config["limits"]["properties"]) == set(Limits.__dataclass_fields__)
    assert set(config["transfer"]["properties"]) == set(TransferConfig.__dataclass_fields__)
    # address and http_address are the chart's (router.grpcPort / httpPort).
    router = config["router"]["properties"]
    assert set(router) == set(RouterConfig.__dataclass_fields__) - {"address", "http_address"}
    assert set(router["tls"]["properties"]) == set(TLSConfig.__dataclass_fields__)
    # The token only as a file: a literal one would sit in the ConfigMap.
    assert set(router["auth"]["properties"]) == {"token_file"}
    group = _schema()["properties"]["workerGroups"]["properties"]["prefill"]
    assert set(group["properties"]["limits"]["properties"]) == set(GROUP_LIMIT_KEYS)


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
