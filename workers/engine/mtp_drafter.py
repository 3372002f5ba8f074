"""MTP drafts: DeepSeek-V3's multi-token-prediction module proposes the token after next.

The module at position ``j`` takes the main model's final hidden state ``h_j`` (which predicted
token ``j + 1``) and the embedding of token ``j + 1``, and predicts token ``j + 2``
(`workers.engine.mtp`). Its decoder layer attends over its own KV of the earlier positions,
kept as the KV pool's last layer (index ``num_layers``): position ``j``'s MTP KV sits in the
slot of the main KV of position ``j``, and a page carries both.

Mixed and decode roles (`workers.engine.speculator`): after every step, once the step's tokens
are sampled, the drafter runs the module over every position the step computed and kept (a
prefill chunk's, a decode's, a verify pass's kept rows), whose next token is now known: its KV
stays valid exactly as far as the main KV (``Sequence.mtp_computed``), and its prediction at a
sequence's last position is the first draft the next step verifies. With
``num_speculative_tokens`` k > 1 the one module is chained for the others (`chain`), as vLLM
serves DeepSeek's single module for k > 1; DeepSeek itself deploys k = 1.

Disaggregated (``EngineConfig.mtp_kv`` on the prefill role): the prefill worker runs the module
over each pass's positions ``j < n - 2`` of an ``n``-token prompt (`write`), in the pass, so the
MTP layer's pages go to the decoder with the others, layer by layer. It stops one position
short of the main KV, as the main KV stops one short of the prompt: the module's output at the
last prefilled position ``n - 2`` is the first draft, and drafting, like sampling, is the
decoder's. The decoder runs that position itself from the hidden state the prefill ships
(`Sequence.mtp_context`), before its first step, which then verifies a draft already.

Tensor parallelism: the module's layer is sharded like the model's (its own embedding, norms,
projection and head are whole on every rank); the leader sends each module step to the
followers (`workers.engine.parallel.TPGroup.send_mtp`) with the hidden states it reads, and only
the leader computes drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from workers.engine.attention import AttentionBatch, create_attention_backend
from workers.engine.cpu_gemm import linear
from workers.engine.layer_progress import LayerProgress
from workers.engine.model import CausalLM
from workers.engine.mtp import MTPModule
from workers.engine.paged_batch import last_rows, paged_batch
from workers.engine.sampler import argmax
from workers.engine.sequence import Sequence as Seq

# (sequence, first position, the main model's final hidden states of the positions from there)
MTPWork = tuple[Seq, int, torch.Tensor]


# Under tensor parallelism, the leader's hand-off of a module step to the followers
# (`workers.engine.parallel.TPGroup.send_mtp`), called before it runs the step itself.
Broadcast = Callable[[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor], None]


class MTPDrafter:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        page_size: int,
        scale: float,
        attention_backend: str,
        broadcast: Broadcast | None = None,
    ) -> None:
        """``kv_cache``: the rank's pool, whose last layer is the module's; ``broadcast``: the
        leader's of a TP group (its followers' drafters run `forward` with what it sends)."""
        module = model.mtp[0]
        assert isinstance(module, MTPModule)
        self.model = model
        self.module = module
        self.page_size = page_size
        self.layer = model.config.num_layers
        assert kv_cache.shape[0] == self.layer + 1, "the pool has no MTP layer"
        self.kv_cache = kv_cache
        self.broadcast = broadcast
        # Its own backend over the shared pool: the main model's keeps the step's batch.
        self.backend = create_attention_backend(attention_backend, kv_cache, page_size, scale=scale)

    @torch.inference_mode()
    def run(self, work: Sequence[MTPWork]) -> tuple[list[int], torch.Tensor]:
        """Write the MTP KV of each item's positions; returns, per item, the draft predicted at
        its last position (the token after the sequence's newest) and the module's output
        there (what a chain continues from, `chain`)."""
        x, batch = self._run(work, None)
        out = x.index_select(0, last_rows(batch))
        return self._drafts(out), out

    @torch.inference_mode()
    def chain(self, items: Sequence[tuple[Seq, int]]) -> list[list[int]]:
        """``k`` drafts per ``(sequence, k)`` item, from its first (``mtp_draft``, predicted at
        position ``N - 2`` of its ``N`` tokens): the module again at positions ``N - 1``,
        ``N`` ..., each reading the draft before and the module's own output at the position
        before (``mtp_hidden``), as DeepSeek's one module serves ``k > 1``. The KV it writes
        past the sequence's MTP KV is scratch: the run after the verifying step rewrites it.
        The sequences' pages must cover ``N + k - 2`` tokens."""
        drafts: list[list[int]] = []
        hidden: list[torch.Tensor] = []
        for seq, _ in items:
            assert seq.mtp_draft is not None and seq.mtp_hidden is not None
            drafts.append([seq.mtp_draft])
            hidden.append(seq.mtp_hidden)
        for depth in range(1, max(k for _, k in items)):
            active = [i for i, (_, k) in enumerate(items) if k > depth]
            runs = []
            for i in active:
                seq = items[i][0]
                runs.append((seq.page_ids, seq.num_tokens - 2 + depth, 1))
            ids = [drafts[i][-1] for i in active]
            rows = torch.stack([hidden[i] for i in active])
            x, _ = self._step(runs, ids, rows, None)
            for row, (i, draft) in enumerate(zip(active, self._drafts(x), strict=True)):
                drafts[i].append(draft)
                hidden[i] = x[row]
        return drafts

    @torch.inference_mode()
    def write(self, work: Sequence[MTPWork], progress: LayerProgress) -> None:
        """Prefill role: write the MTP KV of each item's positions (no drafts) and report the
        layer done to ``progress``, also when there is nothing to write."""
        if work:
            self._run(work, progress)
        else:
            progress.mark_layer_done(self.layer)

    def _run(
        self, work: Sequence[MTPWork], progress: LayerProgress | None
    ) -> tuple[torch.Tensor, AttentionBatch]:
        input_ids: list[int] = []
        for seq, start, hidden in work:
            # Position j reads token j + 1.
            input_ids.extend(seq.token_ids[start + 1 : start + hidden.shape[0] + 1])
        runs = [(seq.page_ids, start, hidden.shape[0]) for seq, start, hidden in work]
        return self._step(runs, input_ids, torch.cat([h for _, _, h in work]), progress)

    def _drafts(self, out: torch.Tensor) -> list[int]:
        """The module's head over output rows: the greedy draft of each."""
        module = self.module
        logits = linear(module.shared_head_norm(out), module.shared_head_weight)
        drafts: list[int] = argmax(logits).tolist()
        return drafts

    def _step(
        self,
        runs: Sequence[tuple[Sequence[int], int, int]],
        input_ids: list[int],
        hidden: torch.Tensor,
        progress: LayerProgress | None,
    ) -> tuple[torch.Tensor, AttentionBatch]:
        """The module's layer over ``runs`` ((page ids, first position, count) each): position
        ``j`` reads ``input_ids``' token and ``hidden``'s row at its place."""
        device = self.kv_cache.device
        positions, batch = paged_batch(runs, self.page_size, device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        if self.broadcast is not None:
            self.broadcast(ids, positions, batch, hidden)
        return self.forward(ids, positions, batch, hidden, progress), batch

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        hidden: torch.Tensor,
        progress: LayerProgress | None = None,
    ) -> torch.Tensor:
        """The module's layer over prepared inputs (every rank of a TP group runs it)."""
        module, model = self.module, self.model
        embeds = F.embedding(input_ids, module.embed_tokens)
        x = linear(
            torch.cat((module.enorm(embeds), module.hnorm(hidden)), -1), module.eh_proj_weight
        )
        rotary = model.rotary.tables(positions, x.dtype, None, max(batch.seq_lens_list))
        self.backend.begin_step(batch)
        out: torch.Tensor = module.layer(self.layer, x, rotary, batch, self.backend, progress)
        return out
