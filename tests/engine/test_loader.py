"""Checkpoint loading: sharded files, dtypes, tied embeddings and the errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.model_helpers import PagedRunner, random_tokens
from workers.engine.cpu_gemm import dense
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.layers import DecoderLayer
from workers.engine.loader import load_model


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(model_dir / "model.safetensors"), {"format": "pt"})


def _logits(model_dir: Path, dtype: str | None = None) -> torch.Tensor:
    model, config = load_model(model_dir, dtype)
    [logits] = PagedRunner(model, config).step([(0, random_tokens(20, seed=5))])
    return logits


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, sharded / name)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for shard, part in enumerate((names[::3], names[1::3], names[2::3])):
        filename = f"model-{shard + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / filename), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    torch.testing.assert_close(_logits(sharded), _logits(tiny_model_dir), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loading(tiny_model_dir: Path, dtype: str) -> None:
    model, _ = load_model(tiny_model_dir, dtype)
    expected = getattr(torch, dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    reference = load_file(str(tiny_model_dir / "model.safetensors"))[
        "model.layers.0.mlp.down_proj.weight"
    ]
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    torch.testing.assert_close(dense(layer.mlp.down_proj_weight), reference.to(expected))


def test_default_dtype_follows_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "bf16")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(model_dir)
    assert model.embed_tokens.dtype == torch.bfloat16
    model, _ = load_model(model_dir, "auto")
    assert model.embed_tokens.dtype == torch.bfloat16
    model, _ = load_model(model_dir, torch.float32)
    assert model.embed_tokens.dtype == torch.float32


def test_tied_embeddings_share_the_head(qwen3_model_dir: Path) -> None:
    assert "lm_head.weight" not in load_file(str(qwen3_model_dir / "model.safetensors"))
    model, config = load_model(qwen3_model_dir)
    assert config.tie_word_embeddings
    # On CPU the head is a packed copy of the embedding (same values); plain, it is the table.
    assert torch.equal(dense(model.lm_head), model.embed_tokens)
    plain, _ = load_model(qwen3_model_dir, prepack=False)
    assert plain.lm_head is plain.embed_tokens


def test_extra_lm_head_of_tied_checkpoint_and_inv_freq_are_ignored(
    qwen3_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = _copy_dir(qwen3_model_dir, tmp_path / "extra")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    _rewrite_tensors(model_dir, tensors)
    torch.testing.assert_close(_logits(model_dir), _logits(qwen3_model_dir), atol=0, rtol=0)


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "arch")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedCheckpointError, match="GPTNeoXForCausalLM"):
        load_model(model_dir)


def test_unsupported_activation(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "gelu")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["hidden_act"] = "gelu"
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedCheckpointError, match="gelu"):
        load_model(model_dir)


def test_missing_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "missing")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    _rewrite_tensors(model_dir, tensors)
    with pytest.raises(UnsupportedCheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj"):
        load_model(model_dir)


def test_untied_checkpoint_without_lm_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "nohead")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    _rewrite_tensors(model_dir, tensors)
    with pytest.raises(UnsupportedCheckpointError, match="lm_head"):
        load_model(model_dir)


def test_unexpected_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "unexpected")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(688)
    _rewrite_tensors(model_dir, tensors)
    with pytest.raises(UnsupportedCheckpointError, match=r"mlp\.gate_proj\.bias"):
        load_model(model_dir)


def test_misshaped_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_model_dir, tmp_path / "shape")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(600, 256)
    _rewrite_tensors(model_dir, tensors)
    with pytest.raises(UnsupportedCheckpointError, match=r"up_proj\.weight has shape \(600, 256\)"):
        load_model(model_dir)


def test_missing_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedCheckpointError, match=r"config\.json"):
        load_model(empty)
    shutil.copy(tiny_model_dir / "config.json", empty / "config.json")
    with pytest.raises(UnsupportedCheckpointError, match="safetensors"):
        load_model(empty)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (empty / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedCheckpointError, match="missing"):
        load_model(empty)


def test_unknown_dtype(tiny_model_dir: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match="float8"):
        load_model(tiny_model_dir, "float8")
