"""``fabric.nics``: ``auto`` (the default: one NIC, as ``node`` sets it) or a list of interface
names or addresses; refused by their form here (whether they exist is known only on the host
each worker lands on: `workers.fabric.nics.resolve_nic`, tested in tests/fabric/test_nics.py),
with several on shm, and together with ``node``. The schema takes and refuses the same."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from orchestrator.config.cluster import ClusterConfig, ConfigError
from orchestrator.config.schema import cluster_config_schema
from orchestrator.control.controller import Controller
from orchestrator.control.registry import Registry
from tests.orchestrator.config.config_helpers import base_dict, set_key

NICS = "groups.decode.fabric.nics"


def load(raw: dict[str, Any]) -> ClusterConfig:
    return ClusterConfig.from_dict(copy.deepcopy(raw))


def test_auto_is_the_default_and_one_nic_as_before(smol_dir: Path) -> None:
    config = load(base_dict(smol_dir))
    fabric = config.group("decode").fabric
    assert fabric is not None and fabric.nics == "auto" and fabric.nic_entries == ()
    assert fabric.node is None


@pytest.mark.parametrize(
    "nics", [["eth1", "eth2"], ["127.0.0.2", "127.0.0.3"], ["fd00::2"], "auto"]
)
def test_a_list_of_interfaces_or_addresses_is_taken(smol_dir: Path, nics: object) -> None:
    raw = base_dict(smol_dir)
    set_key(NICS, nics)(raw)
    jsonschema.validate(raw, cluster_config_schema())
    fabric = load(raw).group("decode").fabric
    assert fabric is not None
    assert fabric.nic_entries == (() if nics == "auto" else tuple(nics))  # type: ignore[arg-type]


REFUSALS: list[tuple[Callable[[dict[str, Any]], None], str, str]] = [
    (set_key(NICS, []), NICS, "an empty list opens no NIC"),
    (set_key(NICS, "eth1"), NICS, "must be auto or a list"),
    (set_key(NICS, ["eth1", "eth1"]), f"{NICS}.1", "listed twice"),
    (set_key(NICS, ["eth1", ""]), f"{NICS}.1", "non-empty string"),
    (set_key(NICS, ["0.0.0.0"]), f"{NICS}.0", "every interface"),
    (set_key(NICS, ["my nic"]), f"{NICS}.0", "neither an IP address nor an interface name"),
    (set_key(NICS, ["a" * 16]), f"{NICS}.0", "neither an IP address nor an interface name"),
    (set_key(NICS, ["auto", "eth1"]), f"{NICS}.0", "auto stands alone"),
    (set_key(NICS, [f"eth{i}" for i in range(17)]), NICS, "at most 16 NICs"),
]


@pytest.mark.parametrize(("mutate", "path", "message"), REFUSALS)
def test_malformed_lists_are_refused_naming_the_entry(
    smol_dir: Path, mutate: Callable[[dict[str, Any]], None], path: str, message: str
) -> None:
    raw = base_dict(smol_dir)
    mutate(raw)
    with pytest.raises(ConfigError, match=message) as caught:
        load(raw)
    assert caught.value.path == path


def test_schema_refuses_a_list_that_is_no_list_of_nics(smol_dir: Path) -> None:
    for nics in ([], "eth1", ["eth1", "eth1"], [""]):
        raw = base_dict(smol_dir)
        set_key(NICS, nics)(raw)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(raw, cluster_config_schema())


def test_several_nics_on_shm_are_refused(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    for role in ("prefill", "decode"):
        raw["groups"][role]["fabric"] = {"provider": "shm", "nics": ["127.0.0.2", "127.0.0.3"]}
    with pytest.raises(ConfigError, match="shm moves KV through the host's memory") as caught:
        load(raw)
    assert caught.value.path == "groups.prefill.fabric.nics"


def test_node_and_a_list_of_nics_are_refused_together(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["groups"]["decode"]["fabric"] = {"node": "127.0.0.2", "nics": ["127.0.0.3"]}
    with pytest.raises(ConfigError, match="node or a list of nics, not both") as caught:
        load(raw)
    assert caught.value.path == NICS


def test_the_worker_spec_carries_the_list(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    set_key(NICS, ["127.0.0.2", "127.0.0.3"])(raw)
    config = load(raw)
    controller = Controller(config, Registry())  # `_spec` needs no Ray
    decode = controller._spec(config.group("decode"), "decode-0")
    prefill = controller._spec(config.group("prefill"), "prefill-0")
    assert decode.fabric_nics == ("127.0.0.2", "127.0.0.3") and decode.fabric_node is None
    assert prefill.fabric_nics == ()  # auto: one engine on fabric_node, as before
