"""Load HF checkpoint directories (config.json + safetensors) into a `CausalLM`.

Accepts a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every
tensor of the checkpoint must map to a parameter and every parameter must be filled, with the
exact shape; anything else is an `UnsupportedCheckpointError` naming the offending tensors.
HF's separate q/k/v and gate/up tensors are copied into our fused parameters (see `layers`).
Under tensor parallelism each rank reads only its own rows / columns of the sharded tensors
(safetensors ``get_slice``), per its `ShardSpec`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.engine.cpu_gemm import can_prepack, pack, prepack_enabled
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.layers import DecoderLayer, Reduce
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.parallel import ShardSpec, shard_spec

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# Buffers some exporters save that we recompute.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype in (None, "auto") else dtype
    assert name is not None
    resolved = _DTYPES.get(name.removeprefix("torch."))
    if resolved is None:
        raise UnsupportedCheckpointError(
            f"unsupported dtype {name!r}; use one of float32, bfloat16, float16, auto"
        )
    return resolved


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, sharded or not."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UnsupportedCheckpointError(f"shards listed in {index} are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise UnsupportedCheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(only safetensors checkpoints are supported)"
    )


@dataclass(frozen=True)
class _Placement:
    """Where (part of) one checkpoint tensor goes.

    ``destination`` receives the checkpoint tensor's indices ``[start, start + n)`` along ``dim``
    (``n`` = the destination's length there), out of ``full`` in the checkpoint; with ``dim``
    None the whole tensor is copied.
    """

    destination: torch.Tensor
    dim: int | None = None
    start: int = 0
    full: int = 0

    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.destination.shape)
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)

    def read(self, handle: Any, name: str) -> torch.Tensor:
        """Read only this rank's slice (safetensors ``get_slice`` maps, then copies the rows)."""
        if self.dim is None or self.destination.shape[self.dim] == self.full:
            tensor: torch.Tensor = handle.get_tensor(name)
            return tensor
        stop = self.start + self.destination.shape[self.dim]
        view = handle.get_slice(name)
        sliced: torch.Tensor = (
            view[self.start : stop] if self.dim == 0 else view[:, self.start : stop]
        )
        return sliced


def iter_handles(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(tensor name, open safetensors handle) for every tensor of the checkpoint."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle


def _target(model: CausalLM, name: str, shard: ShardSpec) -> _Placement | None:
    """Where HF tensor ``name`` goes: a (slice of a possibly fused) parameter, and which part
    of the checkpoint tensor this rank reads (column-parallel rows, row-parallel columns)."""
    if name == "model.embed_tokens.weight":
        return _Placement(model.embed_tokens)
    if name == "model.norm.weight":
        return _Placement(model.norm.weight)
    if name == "lm_head.weight":
        return _Placement(model.lm_head)
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or int(match.group(1)) >= len(model.layers):
        return None
    layer = model.layers[int(match.group(1))]
    assert isinstance(layer, DecoderLayer)
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    q, kv = attn.q_size, attn.kv_size
    q_full = shard.tp_size * q
    kv_full = shard.total_kv_heads * head_dim
    # (local offset in the fused parameter, rows, first checkpoint row, checkpoint rows)
    qkv_rows = {
        "q_proj": (0, q, shard.q_head_start * head_dim, q_full),
        "k_proj": (q, kv, shard.kv_head_start * head_dim, kv_full),
        "v_proj": (q + kv, kv, shard.kv_head_start * head_dim, kv_full),
    }
    suffix = match.group(2)
    proj, _, kind = suffix.removeprefix("self_attn.").partition(".")
    if suffix.startswith("self_attn.") and proj in qkv_rows:
        offset, rows, start, full = qkv_rows[proj]
        fused = attn.qkv_proj_weight if kind == "weight" else attn.qkv_proj_bias
        if fused is None:
            return None
        return _Placement(fused.narrow(0, offset, rows), 0, start, full)
    inter, mlp_full = mlp.intermediate_size, shard.tp_size * mlp.intermediate_size
    gate_up = mlp.gate_up_proj_weight
    placements: dict[str, _Placement | None] = {
        "input_layernorm.weight": _Placement(layer.input_layernorm.weight),
        "post_attention_layernorm.weight": _Placement(layer.post_attention_layernorm.weight),
        "self_attn.o_proj.weight": _Placement(
            attn.o_proj_weight, 1, shard.q_head_start * head_dim, q_full
        ),
        "self_attn.o_proj.bias": (
            _Placement(attn.o_proj_bias) if attn.o_proj_bias is not None else None
        ),
        "self_attn.q_norm.weight": _Placement(attn.q_norm.weight) if attn.q_norm else None,
        "self_attn.k_norm.weight": _Placement(attn.k_norm.weight) if attn.k_norm else None,
        "mlp.gate_proj.weight": _Placement(
            gate_up.narrow(0, 0, inter), 0, shard.mlp_start, mlp_full
        ),
        "mlp.up_proj.weight": _Placement(
            gate_up.narrow(0, inter, inter), 0, shard.mlp_start, mlp_full
        ),
        "mlp.down_proj.weight": _Placement(mlp.down_proj_weight, 1, shard.mlp_start, mlp_full),
    }
    return placements.get(suffix)


def expected_tensor_names(config: ModelConfig) -> set[str]:
    """HF names a checkpoint of ``config`` must contain (lm_head only when untied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    if config.o_proj_bias:
        per_layer.append("self_attn.o_proj.bias")
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_layers):
        names.update(f"model.layers.{i}.{suffix}" for suffix in per_layer)
    return names


def check_features(model_dir: Path) -> None:
    """Reject config switches that change the maths in ways this model does not implement."""
    raw = json.loads((model_dir / "config.json").read_text())
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedCheckpointError(f"hidden_act {activation!r} is not supported (only silu)")


def _prepare_cpu_projections(model: CausalLM, prepack: bool) -> None:
    """Lay a CPU model's projection weights out for fast GEMMs (values unchanged).

    Packed for oneDNN where `workers.engine.cpu_gemm` can (the LM head too: a tied head gets a
    packed copy, the embedding table stays plain for row lookups). Otherwise float32 weights are
    stored column-major (the transpose of a contiguous [in, out] matrix), so that ``F.linear``'s
    ``weight.t()`` is contiguous: 1.4-1.6x faster for MKL's few-row decode GEMMs on some CPUs,
    no loss on others. GPUs keep what they were given.
    """
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter is model.embed_tokens or parameter is model.lm_head:
                continue
            if prepack and can_prepack(parameter):
                setattr(module, name, pack(parameter))
            elif (
                parameter.dim() == 2 and parameter.dtype == torch.float32 and not parameter.is_cuda
            ):
                parameter.data = parameter.data.t().contiguous().t()
    if prepack and can_prepack(model.lm_head):
        model.lm_head = pack(model.lm_head)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    *,
    shard: ShardSpec | None = None,
    reduce: Reduce | None = None,
    device: torch.device | str = "cpu",
    prepack: bool | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Build a `CausalLM` from an HF checkpoint directory; returns it in inference mode (eval).

    ``dtype``: None or "auto" keeps the checkpoint's ``torch_dtype``; otherwise "float32",
    "bfloat16", "float16" or a torch dtype. With ``shard`` the model has that rank's shapes and
    only its slices are read; the returned config is the full model's either way. The weights
    are read on the host, then moved to ``device``. ``prepack``: pack a CPU model's projection
    weights for oneDNN (`workers.engine.cpu_gemm`; None: unless ``PDSERVE_CPU_PREPACK=0``).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UnsupportedCheckpointError(f"checkpoint directory {model_dir} does not exist")
    config = ModelConfig.from_dir(model_dir)
    check_features(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    files = checkpoint_files(model_dir)
    shard = shard or shard_spec(config, 1, 0)
    model = CausalLM(shard.local_config(config), torch_dtype, reduce)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, handle in iter_handles(files):
            if _IGNORED.fullmatch(name):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding (some exporters still save a copy)
            placement = _target(model, name, shard)
            if placement is None:
                unexpected.append(name)
                continue
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != placement.checkpoint_shape():
                raise UnsupportedCheckpointError(
                    f"tensor {name} has shape {shape}, "
                    f"expected {placement.checkpoint_shape()} for this config.json"
                )
            placement.destination.copy_(placement.read(handle, name).to(torch_dtype))
            loaded.add(name)
    missing = sorted(expected_tensor_names(config) - loaded)
    if unexpected or missing:
        raise UnsupportedCheckpointError(
            f"checkpoint {model_dir} does not match config.json: "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {sorted(unexpected)[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    model.to(device)  # in place: a tied LM head stays the embedding's Parameter
    num_params = sum(p.numel() for p in model.parameters())
    _prepare_cpu_projections(model, prepack_enabled() if prepack is None else prepack)
    logger.info(
        "loaded %s (%s, %d layers) from %s as %s on %s",
        config.architecture,
        f"{num_params / 1e6:.1f}M params",
        config.num_layers,
        model_dir,
        torch_dtype,
        device,
    )
    return model.eval(), config
