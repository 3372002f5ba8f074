"""Helpers for model tests: a minimal paged-sequence bookkeeper and HF reference logits."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.engine.attention import AttentionBackend, AttentionBatch, create_attention_backend
from workers.engine.layer_progress import LayerProgress
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.presets import preset_config, random_weights, write_random_checkpoint


class PagedRunner:
    """Owns a KV cache and hands out pages in a scrambled order (so page-table bugs show).

    ``step`` runs one forward pass over chunks ``(seq_id, new_token_ids)`` of any lengths and
    returns the float32 logits of every new token, one tensor per chunk.
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        page_size: int = 16,
        num_pages: int = 64,
        backend: str = "torch",
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.kv_cache = torch.zeros(
            config.num_layers,
            num_pages,
            config.kv_planes,
            config.num_kv_heads,
            page_size,
            config.head_dim,
            dtype=model.dtype,
        )
        self.backend: AttentionBackend = create_attention_backend(
            backend, self.kv_cache, page_size, config.attention_scale
        )
        generator = torch.Generator().manual_seed(123)
        self.free_pages = torch.randperm(num_pages, generator=generator).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def build_batch(
        self, chunks: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq_id, tokens in chunks:
            pages = self.pages.setdefault(seq_id, [])
            start = self.lengths.get(seq_id, 0)
            end = start + len(tokens)
            while len(pages) * self.page_size < end:
                pages.append(self.free_pages.pop())
            input_ids += list(tokens)
            positions += list(range(start, end))
            slots += [
                pages[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(start, end)
            ]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.lengths[seq_id] = end
        max_pages = max(len(self.pages[seq_id]) for seq_id, _ in chunks)
        table = [
            self.pages[seq_id] + [-1] * (max_pages - len(self.pages[seq_id]))
            for seq_id, _ in chunks
        ]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        batch = AttentionBatch(
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            context_lens=torch.tensor([s - q for s, q in zip(seq_lens, query_lens, strict=True)]),
            page_table=torch.tensor(table),
            slot_mapping=torch.tensor(slots),
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
        )
        return torch.tensor(input_ids), torch.tensor(positions), batch

    def step(
        self,
        chunks: Sequence[tuple[int, Sequence[int]]],
        progress: LayerProgress | None = None,
    ) -> list[torch.Tensor]:
        input_ids, positions, batch = self.build_batch(chunks)
        hidden = self.model(input_ids, positions, batch, self.backend, progress)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(list(batch.query_lens_list)))


def hf_logits(
    model_dir: Path | str, token_ids: Sequence[int], **config_overrides: object
) -> torch.Tensor:
    """Float32 logits [len, vocab] of HF transformers (eager attention) for one sequence."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def random_tokens(n: int, seed: int, high: int = 256) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=generator).tolist()


def checkpoint_with_config(
    src: Path, dst: Path, changes: Mapping[str, Any] | None = None, drop: Sequence[str] = ()
) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` (weights and tokenizer linked, not copied) whose
    config.json has ``changes`` and lacks the keys in ``drop``."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "config.json":
            (dst / item.name).symlink_to(item)
    raw = {**json.loads((src / "config.json").read_text()), **(changes or {})}
    for key in drop:
        raw.pop(key, None)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def write_variant_checkpoint(
    preset: str,
    out_dir: Path,
    overrides: dict[str, object],
    seed: int = 7,
    scale: Callable[[str], float] = lambda name: 1.0,
) -> Path:
    """Preset ``preset``'s random checkpoint with ``overrides`` in its config.json and random
    weights for that config, each tensor multiplied by ``scale(its name)``."""
    write_random_checkpoint(preset, out_dir, seed)
    raw = {**preset_config(preset), **overrides}
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = random_weights(ModelConfig.from_dict(raw), seed)
    tensors = {name: tensor * scale(name) for name, tensor in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), {"format": "pt"})
    return out_dir


def write_attention_bias_checkpoint(preset: str, out_dir: Path, seed: int = 7) -> Path:
    """Preset ``preset`` with ``attention_bias: true``: q/k/v biases, and an o_proj bias where
    the family has one (Llama, Qwen3), scaled up so that adding it twice would show."""
    return write_variant_checkpoint(
        preset,
        out_dir,
        {"attention_bias": True},
        seed,
        lambda name: 10.0 if name.endswith("o_proj.bias") else 1.0,
    )


def reference_mtp_draft(model_dir: Path, tokens: list[int]) -> int:
    """The MTP module's prediction of the token after ``tokens`` (`reference_mtp_drafts`)."""
    return reference_mtp_drafts(model_dir, tokens, 1)[0]


def reference_mtp_drafts(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    """``k`` drafts after ``tokens``, computed from scratch: the main model's final hidden
    states of positions 0 .. m-1 (m = len(tokens) - 1) in one pass, the module over those
    positions with tokens 1 .. m, causal, its head at the last position (the first draft);
    then the module one position further for each next draft, reading the draft before and its
    own output at the position before."""
    from workers.engine.cpu_gemm import linear
    from workers.engine.loader import load_model

    model, config = load_model(model_dir)
    main = PagedRunner(model, config)
    ids, positions, batch = main.build_batch([(0, tokens[:-1])])
    hidden = model(ids, positions, batch, main.backend)
    module = model.mtp[0]
    cache = torch.zeros((1, *main.kv_cache.shape[1:]))
    backend = create_attention_backend("torch", cache, main.page_size, config.attention_scale)
    inputs = torch.tensor(tokens[1:])
    drafts: list[int] = []
    while True:
        embeds = torch.nn.functional.embedding(inputs, module.embed_tokens)
        x = torch.cat((module.enorm(embeds), module.hnorm(hidden)), -1)
        x = linear(x, module.eh_proj_weight)
        backend.begin_step(batch)
        x = module.layer(0, x, model.rotary.tables(positions, x.dtype), batch, backend, None)
        logits = linear(module.shared_head_norm(x[-1:]), module.shared_head_weight)
        drafts.append(int(logits.argmax()))
        if len(drafts) == k:
            return drafts
        # The next position: this draft as its token, this output as its hidden state (the
        # main runner's bookkeeping only places it in the pages).
        _, positions, batch = main.build_batch([(0, [drafts[-1]])])
        inputs, hidden = torch.tensor(drafts[-1:]), x[-1:]
