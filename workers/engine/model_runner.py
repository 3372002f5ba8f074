"""Turns a scheduled step into tensors and runs the model; owns every tensor of the step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.layer_progress import LayerProgress
from workers.engine.model import CausalLM
from workers.engine.paged_batch import paged_batch
from workers.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from workers.engine.decode_graphs import DecodeGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        page_size: int,
        layer_progress: LayerProgress,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.layer_progress = layer_progress
        self.device = device
        # Pure-decode steps at fixed shapes (CUDA graphs on a GPU), set by the engine.
        self.decode_graphs: DecodeGraphs | None = None
        # Keep every row's final hidden state of the last step (MTP drafts read them).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, step: SchedulerOutput) -> torch.Tensor | None:
        """One forward pass; returns float32 logits of the sequences that sample, in order:
        one row each, or ``1 + k`` for a sequence verifying ``k`` drafts (its last rows).

        Returns None when no sequence samples (the prefill role): the LM head is skipped.
        """
        if (
            self.decode_graphs is not None
            and not self.keep_hidden
            and self.decode_graphs.accepts(step)
        ):
            return self.decode_graphs.run(step)
        input_ids, positions, batch = self.prepare(step)
        hidden = self.model.forward(input_ids, positions, batch, self.backend, self.layer_progress)
        if self.keep_hidden:
            self.last_hidden = hidden
        sample_rows: list[int] = []
        end = 0
        for seq, chunk, query_len in zip(
            step.seqs, step.chunks, batch.query_lens_list, strict=True
        ):
            end += query_len
            if chunk.samples:
                sample_rows.extend(range(end - 1 - len(seq.spec_token_ids), end))
        if not sample_rows:
            return None
        if len(sample_rows) == hidden.shape[0]:
            # Every row samples (a pure decode step): no row gather.
            return self.model.compute_logits(hidden)
        index = torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))

    def prepare(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        input_ids: list[int] = []
        runs = []
        for seq, num_new in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids.extend(seq.step_token_ids(start, start + num_new))
            runs.append((seq.page_ids, start, num_new))
        # Only dynamic-NTK RoPE reads the prompt lengths: no tensor (and device copy) otherwise.
        prompt_lens = (
            [seq.num_prompt_tokens for seq in step.seqs] if self.model.rotary.is_dynamic else None
        )
        positions, batch = paged_batch(runs, self.page_size, self.device, prompt_lens)
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), positions, batch
