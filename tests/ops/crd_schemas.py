"""Minimal structural schemas of the custom resources the chart renders.

kubernetes-validate knows only built-in kinds. These schemas hold the fields of KubeRay's
RayCluster (ray.io/v1) and the Prometheus operator's ServiceMonitor / PodMonitor
(monitoring.coreos.com/v1) that the chart may write, closed with ``additionalProperties: false``
so that a misspelt field fails here rather than being dropped by the API server's pruning. Pod
templates inside a RayCluster are checked separately against Kubernetes' own PodTemplateSpec.
"""

from __future__ import annotations

from typing import Any

_STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP},
}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": required or [],
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


# KubeRay passes every rayStartParams value to `ray start` as a string; numbers are rejected.
_RAY_START_PARAMS: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE: dict[str, Any] = {"type": "object", "required": ["spec"]}  # checked on its own

RAY_CLUSTER = _resource(
    "ray.io/v1",
    "RayCluster",
    _closed(
        {
            "rayVersion": {"type": "string"},
            "enableInTreeAutoscaling": {"type": "boolean"},
            "suspend": {"type": "boolean"},
            "authOptions": _closed(
                {"mode": {"enum": ["disabled", "token"]}, "secretName": {"type": "string"}}
            ),
            "headGroupSpec": _closed(
                {
                    "rayStartParams": _RAY_START_PARAMS,
                    "template": _POD_TEMPLATE,
                    "serviceType": {"type": "string"},
                    "enableIngress": {"type": "boolean"},
                },
                ["rayStartParams", "template"],
            ),
            "workerGroupSpecs": {
                "type": "array",
                "items": _closed(
                    {
                        "groupName": {
                            "type": "string",
                            "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                        },
                        "replicas": {"type": "integer", "minimum": 0},
                        "minReplicas": {"type": "integer", "minimum": 0},
                        "maxReplicas": {"type": "integer", "minimum": 0},
                        "numOfHosts": {"type": "integer", "minimum": 1},
                        "rayStartParams": _RAY_START_PARAMS,
                        "template": _POD_TEMPLATE,
                        "suspend": {"type": "boolean"},
                    },
                    ["groupName", "rayStartParams", "template"],
                ),
            },
        },
        ["headGroupSpec"],
    ),
)

_ENDPOINT = _closed(
    {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
        },
        "scheme": {"enum": ["http", "https"]},
    },
    ["port"],
)
_SELECTOR = _closed(
    {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ["key", "operator"],
            ),
        },
    }
)
SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _closed(
        {"selector": _SELECTOR, "endpoints": {"type": "array", "items": _ENDPOINT}}, ["selector"]
    ),
)
POD_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    _closed(
        {"selector": _SELECTOR, "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT}},
        ["selector"],
    ),
)

CUSTOM_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("ray.io/v1", "RayCluster"): RAY_CLUSTER,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
}
