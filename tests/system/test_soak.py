"""The short soak: mixed greedy / sampled traffic with random cancels and two
worker kills (a prefill and a decode worker) on a 1P:2D cluster over real Ray, gRPC and libfabric
tcp. ``make soak`` runs the long one (bench/soak.py; figures in bench/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from orchestrator.control.controller import ControllerOptions
from tests.system.cluster_helpers import ServedCluster, cluster_config, disaggregated_groups

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pdserve_bench_soak", ROOT / "bench" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_short_soak_loses_nothing_and_serves_identical_greedy_tokens(
    ray_local: None, tiny_model_dir: Path
) -> None:
    soak = load_soak()
    served = ServedCluster(
        cluster_config(
            tiny_model_dir,
            disaggregated_groups(1, 2),
            transfer={"deadline_seconds": 5, "drain_interval_seconds": 1},
        ),
        ControllerOptions(health_interval_seconds=0.5, health_timeout_seconds=5),
    )
    try:
        options = soak.SoakOptions(
            duration_s=30, rate=3.0, kills=2, seed=1, max_tokens=24, idle_timeout_s=180
        )
        report = soak.run_soak(served.app, tiny_model_dir, options)
    finally:
        served.close()
    assert report.problems == [], report
    # The run exercised what it claims to: kills of both roles, cancels, greedy checks.
    assert sorted(k.split("-")[0] for k in report.kills) == ["decode", "prefill"]
    assert report.cancelled > 0 and report.greedy_checked > 0 and report.completed > 0
    assert report.sent == report.completed + report.cancelled + sum(report.errored.values())
    # Each error is attributed to the kill before it.
    attributed = sum(sum(c.values()) for c in report.errored_after_kill.values())
    assert attributed == sum(report.errored.values())
