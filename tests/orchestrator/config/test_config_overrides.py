"""Command-line overrides revalidate; the config is frozen, hashable and picklable; the auth token
comes from a file and stays out of repr; each group's engine config."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pydantic
import pytest
import yaml

from orchestrator.config.cluster import (
    ClusterConfig,
    ConfigError,
)
from orchestrator.control.launch import add_serve_arguments, config_from_args
from tests.orchestrator.config.config_helpers import (
    SMOLLM2_SHAPE,
    TINY_SHAPE,
    base_dict,
    write_model,
)

# --- overrides and immutability -------------------------------------------------------------


def test_overrides_return_a_new_validated_config(
    tmp_path: Path, smol_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    other = write_model(tmp_path / "other", **SMOLLM2_SHAPE)
    monkeypatch.chdir(tmp_path)
    changed = config.with_overrides(model="other", address="0.0.0.0:6000")
    assert changed.model == other.resolve()  # relative --model: against the working directory
    assert (changed.router.host, changed.router.port) == ("0.0.0.0", 6000)
    assert (config.model, config.router.address) == (smol_dir.resolve(), "127.0.0.1:0")
    assert config.with_overrides() is config
    assert changed.with_overrides(address="[::1]:7000").router.host == "::1"
    with pytest.raises(ConfigError, match=r"^router\.address: must be 'host:port'"):
        config.with_overrides(address="nowhere")


@pytest.mark.parametrize("word", ["none", "None", "NULL", "off", " none "])
def test_http_address_override_none_serves_no_http(smol_dir: Path, word: str) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    assert config.router.http_address is not None
    assert config.with_overrides(http_address=word).router.http_address is None
    changed = config.with_overrides(http_address="0.0.0.0:8080")
    assert changed.router.http_host_port == ("0.0.0.0", 8080)
    assert config.with_overrides(http_address=None).router.http_address == (
        config.router.http_address
    )


def test_command_line_http_address_none(tmp_path: Path, smol_dir: Path) -> None:
    """``--http-address none`` (as `pdserve serve` and `orchestrator.control.launch` parse it)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(base_dict(smol_dir)))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(path), "--http-address", "None"])
    assert config_from_args(args).router.http_address is None
    args = parser.parse_args([str(path), "--http-address", "127.0.0.1:0"])
    assert config_from_args(args).router.http_address == "127.0.0.1:0"
    args = parser.parse_args([str(path), "--http-address", "nowhere"])
    with pytest.raises(ConfigError, match=r"^router\.http_address: must be 'host:port'"):
        config_from_args(args)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "fd00::5", "worker-0.svc", None])
def test_worker_host_takes_hosts_and_wildcards(smol_dir: Path, host: str | None) -> None:
    raw = base_dict(smol_dir)
    raw["worker_host"] = host
    assert ClusterConfig.from_dict(raw).worker_host == host


def test_auth_token_may_come_from_a_file(tmp_path: Path, smol_dir: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("s3cret\n")  # as a mounted Secret holds it
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = {"token_file": "secrets/token"}  # relative to the YAML file
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = ClusterConfig.from_yaml(path)
    assert config.router.auth.token == "s3cret"
    assert "s3cret" not in repr(config)
    raw["router"]["auth"] = {"token_file": None}
    assert ClusterConfig.from_dict(raw).router.auth.token is None


@pytest.mark.parametrize(
    ("auth", "phrase"),
    [
        ({"token_file": "absent"}, "cannot read"),
        ({"token_file": "empty"}, "is empty"),
        ({"token_file": "empty", "token": "x"}, "not both"),
    ],
)
def test_bad_token_file_is_rejected(
    tmp_path: Path, smol_dir: Path, auth: dict[str, str], phrase: str
) -> None:
    (tmp_path / "empty").write_text("\n")
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = auth
    with pytest.raises(ConfigError, match=rf"^router\.auth\.token_file: .*{phrase}"):
        ClusterConfig.from_dict(raw, base_dir=tmp_path)


def test_model_override_reruns_the_model_rules(tmp_path: Path, smol_dir: Path) -> None:
    tiny = write_model(tmp_path / "tiny", **TINY_SHAPE)
    raw = base_dict(tiny)
    raw["groups"]["decode"]["tp"] = 2
    config = ClusterConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"^groups\.decode\.tp: 2 must divide the model's 3 KV"):
        config.with_overrides(model=smol_dir)


def test_config_is_frozen_hashable_and_picklable(smol_dir: Path) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.page_size = 32  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.group("decode").tp = 2  # type: ignore[misc]
    assert hash(config) == hash(ClusterConfig.from_dict(base_dict(smol_dir)))
    # The control plane ships the config to Ray actors.
    assert pickle.loads(pickle.dumps(config)) == config


def test_engine_config_per_group(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["groups"]["decode"]["limits"] = {"max_num_seqs": 128, "num_pages": 256}
    config = ClusterConfig.from_dict(raw)
    decode = config.engine_config("decode")
    prefill = config.engine_config("prefill")
    assert (decode.role, decode.max_num_seqs, decode.num_pages) == ("decode", 128, 256)
    assert (prefill.role, prefill.max_num_seqs, prefill.num_pages) == ("prefill", 64, 128)
    assert decode.max_model_len == prefill.max_model_len == 1024
    assert decode.dtype == "float32" and decode.page_size == 16
    with pytest.raises(KeyError, match="no 'mixed' group"):
        config.engine_config("mixed")


def test_auth_token_stays_out_of_repr(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = {"token": "s3cret"}
    config = ClusterConfig.from_dict(raw)
    assert config.router.auth.token == "s3cret"
    assert "s3cret" not in repr(config)
