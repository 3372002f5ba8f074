"""Where each HF checkpoint tensor goes in a `CausalLM`, and which tensors a checkpoint must have.

HF's separate q/k/v and gate/up tensors land in our fused parameters (see `layers`); DeepSeek's
per-expert tensors in the stacked expert parameters of `moe.MoE`; the MTP modules' tensors (at
layer indices past the last layer) in `mtp.MTPModule`. Under tensor parallelism each rank reads
only its rows / columns of the sharded tensors, per its `ShardSpec`, and skips the routed
experts of other ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.layers import MLP, Attention, DecoderLayer
from workers.engine.mla import MLAttention
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.moe import MoE
from workers.engine.mtp import MTPModule
from workers.engine.parallel import ShardSpec

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_EXPERT_TENSOR = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# MTP-only tensors (the module's decoder layer uses the usual layer names).
_MTP_TENSORS = (
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)


@dataclass(frozen=True)
class Placement:
    """Where (part of) one checkpoint tensor goes.

    ``destination`` receives the checkpoint tensor's indices ``[start, start + n)`` along ``dim``
    (``n`` = the destination's length there), out of ``full`` in the checkpoint; with ``dim``
    None the whole tensor is copied. A None ``destination``: the tensor is another rank's (a
    routed expert it holds); nothing is read.
    """

    destination: torch.Tensor | None
    dim: int | None = None
    start: int = 0
    full: int = 0

    def checkpoint_shape(self) -> tuple[int, ...] | None:
        if self.destination is None:
            return None
        shape = list(self.destination.shape)
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)

    def read(self, handle: Any, name: str) -> torch.Tensor:
        """Read only this rank's slice (safetensors ``get_slice`` maps, then copies the rows)."""
        assert self.destination is not None
        if self.dim is None or self.destination.shape[self.dim] == self.full:
            tensor: torch.Tensor = handle.get_tensor(name)
            return tensor
        stop = self.start + self.destination.shape[self.dim]
        view = handle.get_slice(name)
        sliced: torch.Tensor = (
            view[self.start : stop] if self.dim == 0 else view[:, self.start : stop]
        )
        return sliced


def target(model: CausalLM, name: str, shard: ShardSpec) -> Placement | None:
    """Where HF tensor ``name`` goes (None: nowhere, an unexpected tensor)."""
    if name == "model.embed_tokens.weight":
        return Placement(model.embed_tokens)
    if name == "model.norm.weight":
        return Placement(model.norm.weight)
    if name == "lm_head.weight":
        return Placement(model.lm_head)
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None:
        return None
    index, suffix = int(match.group(1)), match.group(2)
    if index < len(model.layers):
        layer = model.layers[index]
        assert isinstance(layer, DecoderLayer)
        return _layer_target(layer, suffix, shard)
    mtp_index = index - len(model.layers)
    if mtp_index >= len(model.mtp):
        return None
    module = model.mtp[mtp_index]
    assert isinstance(module, MTPModule)
    mtp_own: dict[str, torch.Tensor] = {
        "embed_tokens.weight": module.embed_tokens,
        "enorm.weight": module.enorm.weight,
        "hnorm.weight": module.hnorm.weight,
        "eh_proj.weight": module.eh_proj_weight,
        "shared_head.norm.weight": module.shared_head_norm.weight,
        "shared_head.head.weight": module.shared_head_weight,
    }
    if suffix in mtp_own:
        return Placement(mtp_own[suffix])
    return _layer_target(module.layer, suffix, shard)


def _layer_target(layer: DecoderLayer, suffix: str, shard: ShardSpec) -> Placement | None:
    if suffix == "input_layernorm.weight":
        return Placement(layer.input_layernorm.weight)
    if suffix == "post_attention_layernorm.weight":
        return Placement(layer.post_attention_layernorm.weight)
    if suffix.startswith("self_attn."):
        attn = layer.self_attn
        tensor = suffix.removeprefix("self_attn.")
        if isinstance(attn, MLAttention):
            return _mla_target(attn, tensor, shard)
        return _attention_target(attn, tensor, shard)
    if suffix.startswith("mlp."):
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            return _moe_target(mlp, suffix, shard)
        return _mlp_target(mlp, suffix.removeprefix("mlp."), shard)
    return None


def _attention_target(attn: Attention, tensor: str, shard: ShardSpec) -> Placement | None:
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
    proj, _, kind = tensor.partition(".")
    if proj in qkv_rows:
        offset, rows, start, full = qkv_rows[proj]
        fused = attn.qkv_proj_weight if kind == "weight" else attn.qkv_proj_bias
        if fused is None:
            return None
        return Placement(fused.narrow(0, offset, rows), 0, start, full)
    if tensor == "o_proj.weight":
        return Placement(attn.o_proj_weight, 1, shard.q_head_start * head_dim, q_full)
    if tensor == "o_proj.bias":
        return Placement(attn.o_proj_bias) if attn.o_proj_bias is not None else None
    if tensor == "q_norm.weight":
        return Placement(attn.q_norm.weight) if attn.q_norm else None
    if tensor == "k_norm.weight":
        return Placement(attn.k_norm.weight) if attn.k_norm else None
    return None


def _mla_target(attn: MLAttention, tensor: str, shard: ShardSpec) -> Placement | None:
    mla, first = attn.mla, shard.q_head_start
    heads = shard.tp_size * attn.num_heads

    def by_head(param: torch.Tensor | None, per_head: int, dim: int) -> Placement | None:
        if param is None:
            return None
        return Placement(param, dim, first * per_head, heads * per_head)

    if tensor == "q_proj.weight":
        return by_head(attn.q_proj_weight, mla.qk_head_dim, 0)
    if tensor == "q_b_proj.weight":
        return by_head(attn.q_b_proj_weight, mla.qk_head_dim, 0)
    if tensor == "kv_b_proj.weight":
        return by_head(attn.kv_b_proj_weight, mla.qk_nope_head_dim + mla.v_head_dim, 0)
    if tensor == "o_proj.weight":
        return by_head(attn.o_proj_weight, mla.v_head_dim, 1)
    replicated: dict[str, torch.Tensor | None] = {
        "q_a_proj.weight": attn.q_a_proj_weight,
        "q_a_layernorm.weight": attn.q_a_layernorm.weight if attn.q_a_layernorm else None,
        "kv_a_proj_with_mqa.weight": attn.kv_a_proj_with_mqa_weight,
        "kv_a_layernorm.weight": attn.kv_a_layernorm.weight,
    }
    param = replicated.get(tensor)
    return Placement(param) if param is not None else None


def _mlp_target(mlp: MLP, tensor: str, shard: ShardSpec) -> Placement | None:
    inter = mlp.intermediate_size
    full, start = shard.tp_size * inter, shard.rank * inter
    gate_up = mlp.gate_up_proj_weight
    if tensor == "gate_proj.weight":
        return Placement(gate_up.narrow(0, 0, inter), 0, start, full)
    if tensor == "up_proj.weight":
        return Placement(gate_up.narrow(0, inter, inter), 0, start, full)
    if tensor == "down_proj.weight":
        return Placement(mlp.down_proj_weight, 1, start, full)
    return None


def _moe_target(moe: MoE, suffix: str, shard: ShardSpec) -> Placement | None:
    if suffix == "mlp.gate.weight":
        return Placement(moe.gate.weight)
    if suffix == "mlp.gate.e_score_correction_bias":
        bias = moe.gate.e_score_correction_bias
        return Placement(bias) if bias is not None else None
    inter = moe.moe.intermediate_size
    expert = _EXPERT_TENSOR.fullmatch(suffix)
    if expert is not None:
        local = int(expert.group(1)) - moe.expert_start
        if int(expert.group(1)) >= moe.moe.num_experts:
            return None
        if not 0 <= local < moe.num_local_experts:
            return Placement(None)  # another rank's expert
        proj = expert.group(2)
        if proj == "down_proj":
            return Placement(moe.experts_down[local])
        offset = 0 if proj == "gate_proj" else inter
        return Placement(moe.experts_gate_up[local].narrow(0, offset, inter))
    shared = moe.shared_intermediate_size
    if moe.shared_gate_up is None or moe.shared_down is None:
        return None
    full, start = shard.tp_size * shared, shard.rank * shared
    if suffix == "mlp.shared_experts.gate_proj.weight":
        return Placement(moe.shared_gate_up.narrow(0, 0, shared), 0, start, full)
    if suffix == "mlp.shared_experts.up_proj.weight":
        return Placement(moe.shared_gate_up.narrow(0, shared, shared), 0, start, full)
    if suffix == "mlp.shared_experts.down_proj.weight":
        return Placement(moe.shared_down, 1, start, full)
    return None


def _attention_names(config: ModelConfig) -> list[str]:
    mla = config.mla
    if mla is not None:
        names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"]
        if mla.q_lora_rank is None:
            names.append("q_proj.weight")
        else:
            names += ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
        names.append("o_proj.weight")
    else:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        if config.attention_bias:
            names += [f"{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
        if config.o_proj_bias:
            names.append("o_proj.bias")
        if config.qk_norm:
            names += ["q_norm.weight", "k_norm.weight"]
    return [f"self_attn.{name}" for name in names]


def _mlp_names(config: ModelConfig, index: int) -> list[str]:
    moe = config.moe
    if moe is None or (index < len(moe.moe_layers) and not moe.moe_layers[index]):
        return [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    names = ["mlp.gate.weight"]
    if moe.topk_method == "noaux_tc":
        names.append("mlp.gate.e_score_correction_bias")
    for expert in range(moe.num_experts):
        names += [f"mlp.experts.{expert}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if moe.num_shared_experts:
        names += [f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def _layer_names(config: ModelConfig, index: int) -> list[str]:
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += _attention_names(config) + _mlp_names(config, index)
    return [f"model.layers.{index}.{name}" for name in names]


def mtp_tensor_names(config: ModelConfig) -> set[str]:
    """The tensors of DeepSeek's MTP modules (layer indices past the last layer)."""
    names: set[str] = set()
    for index in range(config.num_layers, config.num_layers + config.num_mtp_layers):
        names.update(f"model.layers.{index}.{name}" for name in _MTP_TENSORS)
        names.update(_layer_names(config, index))
    return names


def expected_tensor_names(config: ModelConfig) -> set[str]:
    """HF names a checkpoint of ``config`` must contain (lm_head only when untied; the MTP
    modules' too: `mtp_tensor_names`)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for index in range(config.num_layers):
        names.update(_layer_names(config, index))
    return names | mtp_tensor_names(config)
