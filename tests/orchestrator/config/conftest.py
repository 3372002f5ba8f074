"""The stand-in model most config tests load against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.orchestrator.config.config_helpers import SMOLLM2_SHAPE, write_model


@pytest.fixture
def smol_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "smol", **SMOLLM2_SHAPE)
