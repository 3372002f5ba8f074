"""JSON Schema of the cluster config's YAML file, made from the models themselves.

`cluster_config_schema` describes the file as written, which is not quite the models' shape:
``groups`` is a mapping of role to group (the role is the key, not a field), a group's
``limits`` take only `GROUP_LIMIT_KEYS`, and ``router.auth`` may name a ``token_file``. Rules
across keys (prefill with decode, TP against the model) are the loader's alone. The Helm chart's
``values.schema.json`` takes its cluster-config parts from here (``scripts/gen_config_schema.py``).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from orchestrator.config.cluster import GROUP_LIMIT_KEYS, GROUP_ROLES, ClusterConfig

JsonObject = dict[str, Any]

TOKEN_FILE_SCHEMA: JsonObject = {
    "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
    "description": "A file holding the token, read when the config loads (a mounted "
    "Kubernetes Secret, say); relative to the YAML file's directory. Give token or token_file.",
}


def model_schema(model: type[BaseModel]) -> JsonObject:
    """``model``'s validation schema, self-contained: every ``$ref`` inlined, no titles."""
    schema = model.model_json_schema()
    definitions: JsonObject = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = definitions[node["$ref"].rpartition("/")[2]]
            # The field's own keys (its description, say) win over the model's.
            node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return {
            key: " ".join(value.split()) if key == "description" else inline(value)
            for key, value in node.items()
            if key != "title"
        }

    result: JsonObject = inline(schema)
    return result


def cluster_config_schema() -> JsonObject:
    """The schema of a cluster config YAML file (`ClusterConfig.from_yaml`)."""
    schema = model_schema(ClusterConfig)
    schema["description"] = "A pdserve cluster config (orchestrator.config.cluster.ClusterConfig)."
    properties = schema["properties"]
    group = copy.deepcopy(properties["groups"]["items"])
    del group["properties"]["role"]
    group["required"] = [key for key in group.get("required", []) if key != "role"]
    if not group["required"]:
        del group["required"]
    limits = group["properties"]["limits"]
    limits["properties"] = {key: limits["properties"][key] for key in GROUP_LIMIT_KEYS}
    limits["description"] = "Overrides of the top-level limits for this group."
    properties["groups"] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            role: {**group, "description": f"The {role} group."} for role in GROUP_ROLES
        },
        "description": properties["groups"]["description"],
    }
    auth = properties["router"]["properties"]["auth"]
    auth["properties"]["token_file"] = copy.deepcopy(TOKEN_FILE_SCHEMA)
    return schema
