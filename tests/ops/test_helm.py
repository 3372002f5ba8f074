"""The Helm chart: lint, render for the main value combinations, validate what it renders, and
check what each combination renders: worker pods, Ray auth, the cluster secret, monitoring, the
router's Service, the launcher Job, the dashboards."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.control.cluster_secret import CLUSTER_SECRET_ENV, cluster_secret
from tests.ops.crd_schemas import CUSTOM_SCHEMAS
from tests.ops.helm_chart import (
    CHART,
    COMBOS,
    FULLNAME,
    KUBERNETES_VERSION,
    NAMESPACE,
    RELEASE,
    RENDERED,
    REPO,
    default_values,
    env_of,
    first_container,
    groups,
    merge_values,
    one,
    render,
    render_values,
)

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


# --- what the combinations render ---------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_replicas_are_the_ratio_and_resources_follow_values(combo: str) -> None:
    values = merge_values(default_values(), COMBOS[combo])
    rendered = groups(render(combo))
    assert set(rendered) == {"prefill", "decode"}
    for role, group in rendered.items():
        wanted = values["workerGroups"][role]
        assert (
            group["replicas"] == group["minReplicas"] == group["maxReplicas"] == wanted["replicas"]
        )
        limits = first_container(group)["resources"]["limits"]
        assert first_container(group)["resources"]["requests"] == limits
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
        assert set(first_container(group)["resources"]["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("combo", COMBOS)
def test_worker_pods_have_ipc_lock_and_shm(combo: str) -> None:
    for role, group in groups(render(combo)).items():
        container = first_container(group)
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
    assert "securityContext" not in first_container(groups(docs)["decode"])
    assert "securityContext" in first_container(groups(docs)["prefill"])


def test_ray_token_auth_is_on_by_default() -> None:
    docs = render("1p3d-cpu")
    secret = one(docs, "Secret", f"{FULLNAME}-ray-auth")
    assert len(secret["data"]["auth_token"]) >= 48
    cluster = one(docs, "RayCluster")
    job = one(docs, "Job")
    containers = [cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [first_container(g) for g in cluster["spec"]["workerGroupSpecs"]]
    containers += [job["spec"]["template"]["spec"]["containers"][0]]
    for container in containers:
        env = env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULLNAME}-ray-auth", "key": "auth_token"}
    assert "authOptions" not in cluster["spec"]


def test_auth_options_let_kuberay_wire_the_token() -> None:
    docs = render("1p1d-verbs-authoptions")
    cluster = one(docs, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": f"{FULLNAME}-ray-auth"}
    assert "RAY_AUTH_MODE" not in env_of(first_container(groups(docs)["decode"]))
    # The launcher is no Ray container: KubeRay does not inject its env.
    job_env = env_of(one(docs, "Job")["spec"]["template"]["spec"]["containers"][0])
    assert job_env["RAY_AUTH_MODE"]["value"] == "token"


def test_auth_can_be_turned_off() -> None:
    docs = render("no-auth-no-launcher-no-dashboards")
    assert not [d for d in docs if d["kind"] == "Job"]
    # The cluster's own secret stays: it guards the workers, not Ray.
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert secrets == [f"{FULLNAME}-cluster-secret"]
    for group in groups(docs).values():
        assert "RAY_AUTH_MODE" not in env_of(first_container(group))


def test_the_cluster_secret_is_created_and_reaches_only_the_driver() -> None:
    docs = render("1p3d-cpu")
    secret = one(docs, "Secret", f"{FULLNAME}-cluster-secret")
    text = base64.b64decode(secret["data"]["cluster_secret"]).decode()
    assert len(text) == 64
    cluster_secret({CLUSTER_SECRET_ENV: text})  # what the driver takes
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ref = env_of(head)[CLUSTER_SECRET_ENV]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{FULLNAME}-cluster-secret", "key": "cluster_secret"}
    # The workers get the key from the driver, through Ray; nothing else holds it.
    for group in groups(docs).values():
        assert CLUSTER_SECRET_ENV not in env_of(first_container(group))
    assert text not in json.dumps([d for d in docs if d["kind"] != "Secret"])


def test_an_existing_cluster_secret_is_referenced_not_created(chart: Any) -> None:
    docs = render_values(chart, {"clusterSecret": {"existingSecret": "my-cluster-secret"}})
    assert not [d for d in docs if d["kind"] == "Secret" and "cluster" in d["metadata"]["name"]]
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ref = env_of(head)[CLUSTER_SECRET_ENV]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "my-cluster-secret", "key": "cluster_secret"}


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
            assert any(p["name"] == "metrics" for p in first_container(group)["ports"])


def test_router_service_points_at_thehead_spec() -> None:
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
    assert "python -m orchestrator.control.launch cluster.yaml" in script
    assert pod["volumes"][0]["configMap"]["name"] == f"{FULLNAME}-cluster-config"
    env = env_of(pod["containers"][0])
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
