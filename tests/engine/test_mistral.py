"""Mistral checkpoints: transformers' Mistral attention has no biases (``attention_bias`` is
ignored), and sliding-window attention, which the engine does not implement, bounds the
sequence length instead of silently changing the maths past the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import GREEDY, make_engine
from tests.engine.model_helpers import (
    PagedRunner,
    hf_logits,
    random_tokens,
    write_variant_checkpoint,
)
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.errors import InvalidRequestError, UnsupportedCheckpointError
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.presets import preset_config

WINDOW = 48
ATOL = 1e-4


def write_mistral_checkpoint(out_dir: Path, **overrides: object) -> Path:
    """Preset ``tiny`` as a Mistral checkpoint, ``attention_bias: true`` (which transformers'
    Mistral ignores) and a sliding window of ``WINDOW`` tokens unless overridden."""
    mistral = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "attention_bias": True,
        "sliding_window": WINDOW,
    }
    return write_variant_checkpoint("tiny", out_dir, {**mistral, **overrides}, seed=5)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mistral_checkpoint(tmp_path_factory.mktemp("mistral"))


def test_config_ignores_attention_bias_and_reads_the_window(mistral_dir: Path) -> None:
    config = ModelConfig.from_dir(mistral_dir)
    assert (config.attention_bias, config.o_proj_bias) == (False, False)
    assert (config.sliding_window, config.max_len) == (WINDOW, WINDOW)


@pytest.mark.parametrize(
    ("overrides", "window"),
    [
        ({"sliding_window": None}, None),  # Mistral v0.2+: full attention
        ({"use_sliding_window": False, "sliding_window": 4096}, None),  # Qwen2-style switch off
        ({"use_sliding_window": True, "sliding_window": 64}, 64),
    ],
)
def test_sliding_window_switches(overrides: dict[str, object], window: int | None) -> None:
    raw = {**preset_config("tiny"), "architectures": ["MistralForCausalLM"], **overrides}
    config = ModelConfig.from_dict(raw)
    assert config.sliding_window == window
    assert config.max_len == (window or config.max_position_embeddings)


def test_a_bad_window_is_an_unsupported_checkpoint() -> None:
    raw = {**preset_config("tiny"), "architectures": ["MistralForCausalLM"], "sliding_window": 0}
    with pytest.raises(UnsupportedCheckpointError, match="sliding_window"):
        ModelConfig.from_dict(raw)


def test_logits_match_hf_within_the_window(mistral_dir: Path) -> None:
    tokens = random_tokens(WINDOW, seed=4)
    model, config = load_model(mistral_dir)
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    torch.testing.assert_close(ours, hf_logits(mistral_dir, tokens), atol=ATOL, rtol=0)


def test_past_the_window_hf_differs_so_the_engine_stops_there(mistral_dir: Path) -> None:
    # Why the bound exists: past the window transformers' attention is not full attention.
    tokens = random_tokens(WINDOW + 24, seed=6)
    model, config = load_model(mistral_dir)
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    assert not torch.allclose(ours[-1], hf_logits(mistral_dir, tokens)[-1], atol=ATOL, rtol=0)

    engine = make_engine(mistral_dir, num_pages=16)
    assert engine.max_model_len == WINDOW
    with pytest.raises(InvalidRequestError):
        engine.add_request("long", list(range(1, WINDOW + 1)), GREEDY)
    assert engine.block_manager.num_free_pages == 16
    with pytest.raises(UnsupportedCheckpointError, match="sliding window"):
        EngineCore(mistral_dir, EngineConfig(num_pages=16, max_model_len=WINDOW + 1))
