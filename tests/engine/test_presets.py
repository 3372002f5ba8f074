"""Random preset checkpoints: HF loads them offline, the CLI writes them, greedy output varies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.model_helpers import PagedRunner
from workers.engine.loader import load_model
from workers.engine.presets import write_random_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("fixture", "architecture", "sizes"),
    [
        ("tiny_model_dir", "LlamaForCausalLM", (256, 4, 8, 2)),
        ("small_model_dir", "LlamaForCausalLM", (512, 6, 8, 4)),
        ("qwen3_model_dir", "Qwen3ForCausalLM", (256, 4, 8, 2)),
        ("deepseek_model_dir", "DeepseekV3ForCausalLM", (256, 3, 4, 4)),
        ("qwen3_moe_model_dir", "Qwen3MoeForCausalLM", (256, 3, 8, 2)),
    ],
)
def test_hf_loads_preset_offline(
    request: pytest.FixtureRequest, fixture: str, architecture: str, sizes: tuple[int, ...]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir: Path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert type(model).__name__ == architecture
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
    ) == sizes
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_qwen3_preset_head_dim_differs_from_hidden_over_heads(qwen3_model_dir: Path) -> None:
    _, config = load_model(qwen3_model_dir)
    assert config.qk_norm and config.tie_word_embeddings
    assert config.head_dim == 64 != config.hidden_size // config.num_heads


def test_weights_are_deterministic_in_the_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = load_file(str(write_random_checkpoint("tiny", tmp_path / "a") / "model.safetensors"))
    other = load_file(
        str(write_random_checkpoint("tiny", tmp_path / "b", seed=1) / "model.safetensors")
    )
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again[name], original[name])
    assert not torch.equal(other[name], original[name])


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        write_random_checkpoint("huge", tmp_path)


def test_make_model_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli.main",
            "make-model",
            "--preset",
            "qwen3-tiny",
            "--out",
            str(out),
            "--seed",
            "3",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    _, config = load_model(out)
    assert config.architecture == "Qwen3ForCausalLM"


def test_greedy_generation_is_not_degenerate(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir)
    runner = PagedRunner(model, config)
    [logits] = runner.step([(0, list(b"Once upon a time"))])
    generated = [int(logits[-1].argmax())]
    for _ in range(31):
        [logits] = runner.step([(0, generated[-1:])])
        generated.append(int(logits[-1].argmax()))
    assert len(set(generated)) >= 8, generated
