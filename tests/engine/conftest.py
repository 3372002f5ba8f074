"""Checkpoint fixtures shared by the engine tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.presets import write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama preset ``tiny``: hidden 256, 4 layers, 8 heads, 2 KV heads, byte vocabulary."""
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama preset ``small``: hidden 512, 6 layers, 8 heads, 4 KV heads."""
    return write_random_checkpoint("small", tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 preset ``qwen3-tiny``: q/k norm, head_dim 64 != hidden / heads, tied embeddings."""
    return write_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-style checkpoint with q/k/v biases (preset ``qwen2-tiny``)."""
    return write_random_checkpoint("qwen2-tiny", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct in the default pdserve cache (converted once, then reused).

    Tests using it should carry ``@pytest.mark.slow``.
    """
    from workers.engine.demo_model import fetch_demo_model

    return fetch_demo_model(None)
