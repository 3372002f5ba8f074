"""Load HF checkpoint directories (config.json + safetensors) into a `CausalLM`.

Accepts a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every
tensor of the checkpoint must map to a parameter and every parameter must be filled, with the
exact shape; anything else is an `UnsupportedCheckpointError` naming the offending tensors.
Where each tensor goes (fused q/k/v and gate/up, stacked experts, MTP modules, this rank's
slices under tensor parallelism) is `workers.engine.weight_map`'s business. A DeepSeek-V3
checkpoint whose MTP modules were stripped (common in conversions) loads without them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.engine.cpu_gemm import FLOAT32_COPY, can_prepack, pack, prepack_enabled
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.layers import Reduce
from workers.engine.mla import MLAttention
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.parallel import ShardSpec, shard_spec
from workers.engine.weight_map import expected_tensor_names, mtp_tensor_names, target

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


def iter_handles(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(tensor name, open safetensors handle) for every tensor of the checkpoint."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle


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
        # Weights used other than as a projection (`MLAttention`'s per-head views) stay plain.
        unpacked = getattr(module, "NOT_PACKED", ())
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter is model.embed_tokens or parameter is model.lm_head or name in unpacked:
                continue
            if prepack and can_prepack(parameter):
                setattr(module, name, pack(parameter))
            elif (
                parameter.dim() == 2 and parameter.dtype == torch.float32 and not parameter.is_cuda
            ):
                parameter.data = parameter.data.t().contiguous().t()
    if prepack and can_prepack(model.lm_head):
        model.lm_head = pack(model.lm_head)
    weights = {id(w): w for w in (*model.parameters(), model.lm_head)}.values()
    copies = [getattr(w, FLOAT32_COPY) for w in weights if hasattr(w, FLOAT32_COPY)]
    if copies:
        logger.info(
            "this CPU has no native %s dot products: projections of two rows or more run in "
            "float32, on float32 copies of the weights (%.0f MiB more; PDSERVE_CPU_PREPACK=0 "
            "keeps the weights alone)",
            str(model.lm_head.dtype).removeprefix("torch."),
            sum(c.numel() for c in copies) * 4 / 2**20,
        )


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
    model = CausalLM(shard.local_config(config), torch_dtype, reduce, shard.tp_size, shard.rank)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, handle in iter_handles(files):
            if _IGNORED.fullmatch(name):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding (some exporters still save a copy)
            placement = target(model, name, shard)
            if placement is None:
                unexpected.append(name)
                continue
            loaded.add(name)
            if placement.destination is None:
                continue  # another rank's expert
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != placement.checkpoint_shape():
                raise UnsupportedCheckpointError(
                    f"tensor {name} has shape {shape}, "
                    f"expected {placement.checkpoint_shape()} for this config.json"
                )
            # One cast, to the parameter's dtype (routers stay float32 in bfloat16 models).
            placement.destination.copy_(placement.read(handle, name))
    expected = expected_tensor_names(config)
    mtp_names = mtp_tensor_names(config)
    if mtp_names and not mtp_names & loaded:
        logger.info("%s has no MTP weights: loading without them", model_dir)
        model.mtp = torch.nn.ModuleList()
        expected -= mtp_names
    missing = sorted(expected - loaded)
    if unexpected or missing:
        raise UnsupportedCheckpointError(
            f"checkpoint {model_dir} does not match config.json: "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {sorted(unexpected)[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.deinterleave_rope()
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
