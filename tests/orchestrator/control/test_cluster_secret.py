"""The cluster's secret (`orchestrator.control.cluster_secret`): ``$PDSERVE_CLUSTER_SECRET``
(the Helm chart's Secret) gives the same key to every start, so a restarted driver's workers
and router share it; unset, each cluster draws its own; too short, ``pdserve serve`` refuses
it in one line that never repeats the value. The controller hands the key to its workers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig
from orchestrator.control.cluster_secret import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    cluster_secret,
)
from orchestrator.control.controller import Controller
from orchestrator.control.registry import Registry

TEXT = "q" * 31 + "Z"  # 32 characters: the shortest taken


def test_a_given_secret_gives_the_same_key_every_time() -> None:
    key = cluster_secret({CLUSTER_SECRET_ENV: f"  {TEXT}\n"})
    assert key == hashlib.sha256(TEXT.encode()).hexdigest()
    assert cluster_secret({CLUSTER_SECRET_ENV: TEXT}) == key
    assert bytes.fromhex(key) and len(key) == 64  # a worker's MAC key and gRPC token


def test_without_one_each_cluster_draws_its_own() -> None:
    drawn = {cluster_secret({}), cluster_secret({CLUSTER_SECRET_ENV: " "})}
    assert len(drawn) == 2 and all(len(bytes.fromhex(key)) == 32 for key in drawn)


def test_a_short_secret_is_refused_without_repeating_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ClusterSecretError, match="holds 6 characters; give at least 32"):
        cluster_secret({CLUSTER_SECRET_ENV: "hunter"})
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tmp_path / 'absent'}\ngroups:\n  mixed: {{replicas: 1}}\n")
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "hunter")
    assert main(["serve", str(config)]) == 2  # before Ray starts
    err = capsys.readouterr().err
    assert err.startswith("error: $PDSERVE_CLUSTER_SECRET holds 6 characters")
    assert "hunter" not in err


def test_the_controller_hands_its_secret_to_every_worker(tmp_path: Path) -> None:
    config = ClusterConfig.from_dict(
        {"model": str(tmp_path / "absent"), "groups": {"mixed": {"replicas": 1}}}
    )
    key = cluster_secret({CLUSTER_SECRET_ENV: TEXT})
    controller = Controller(config, Registry(), secret=key)
    assert controller.secret == key
    assert controller._spec(config.group("mixed"), "mixed-0").cluster_secret == key
    assert Controller(config, Registry()).secret != key  # none given: drawn
