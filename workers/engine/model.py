"""Decoder-only causal LM over a paged KV cache: Llama / Mistral / Qwen2 / Qwen3, Qwen3-MoE,
DeepSeek-V2 / V3 (their layers differ in `workers.engine.layers.DecoderLayer`).

One forward pass takes the flattened batch of the step (prefill chunks and decode tokens
together, see `attention.base`) and returns the final-norm hidden states of every token;
`CausalLM.compute_logits` projects only the rows the caller needs (usually the last token of
each sequence). Weights come from `workers.engine.loader.load_model`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.cpu_gemm import linear
from workers.engine.layer_progress import LayerProgress
from workers.engine.layers import DecoderLayer, Reduce, RMSNorm
from workers.engine.model_config import ModelConfig
from workers.engine.mtp import MTPModule
from workers.engine.rope import RotaryEmbedding


class CausalLM(nn.Module):
    """Decoder-only transformer with uninitialised weights (fill them with the loader).

    With ``tie_word_embeddings`` the LM head is the embedding matrix itself (one Parameter;
    the loader gives a CPU model a packed copy of it, `workers.engine.cpu_gemm`).
    Under tensor parallelism ``config`` is the rank's local config, ``reduce`` the all-reduce
    of the row-parallel projections and ``tp_size`` / ``tp_rank`` pick the rank's experts
    (`workers.engine.parallel`). DeepSeek-V3's MTP modules, when the checkpoint has them, are
    in ``mtp`` (not run by `forward`; the loader empties it when the checkpoint lacks them).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        reduce: Reduce | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, reduce, index, tp_size, tp_rank)
            for index in range(config.num_layers)
        )
        self.mtp = nn.ModuleList(
            MTPModule(config, dtype, index, reduce, tp_size, tp_rank)
            for index in range(config.num_mtp_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                requires_grad=False,
            )
        )
        self.rotary = RotaryEmbedding(config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
        progress: LayerProgress | None = None,
    ) -> torch.Tensor:
        """Run every layer over the step's ``T`` new tokens; returns hidden [T, hidden_size].

        Calls ``backend.begin_step(batch)`` before layer 0, and, when given, ``progress``'s
        ``begin_pass`` before layer 0 and ``mark_layer_done(l)`` after layer l's o_proj.
        """
        token_seq_lens = dynamic_rope_seq_lens(positions, batch) if self.rotary.is_dynamic else None
        # A token's position is below its sequence's length: a bound known on the host.
        bound = max(batch.seq_lens_list, default=0)
        rotary = self.rotary.tables(positions, self.dtype, token_seq_lens, bound)
        hidden = F.embedding(input_ids, self.embed_tokens)
        backend.begin_step(batch)
        if progress is not None:
            progress.begin_pass()
        for index, layer in enumerate(self.layers):
            hidden = layer(index, hidden, rotary, batch, backend, progress)
        return self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return linear(hidden, self.lm_head).to(torch.float32)


def dynamic_rope_seq_lens(positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """[T] the sequence length HF's dynamic NTK RoPE scales each new token by.

    HF ``generate`` runs the whole prompt in one pass (length: the prompt's) and then one pass
    per output token (length: its position + 1); cached keys keep the base of the pass that
    wrote them. ``max(prompt length, position + 1)`` gives every token that same length however
    the prompt is chunked, batched or recomputed after a preemption, so the cache holds what
    HF's would (a chunk's end would give early chunks a smaller base).
    """
    lens = batch.num_prompt_tokens if batch.num_prompt_tokens is not None else batch.seq_lens
    query_lens = torch.tensor(batch.query_lens_list, device=lens.device)
    per_token = torch.repeat_interleave(lens.to(positions.device), query_lens.to(positions.device))
    return torch.maximum(per_token, positions + 1)
