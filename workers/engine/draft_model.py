"""Draft-model drafts: a smaller checkpoint with the same tokenizer guesses the next tokens.

The draft model keeps its own paged KV pool, of its own shape but with the main pool's page
count, addressed by the main pool's page ids: position ``j`` of a sequence has its draft KV in the
slot of its main KV. Before a step, every running sequence about to decode catches its draft KV up
over the tokens it has not seen (``Sequence.draft_computed``: after a prompt, the whole prompt;
after a step, the tokens that step kept), ending with its newest token, whose logits give the
first draft; each further draft is one more single-token pass. Drafts are greedy (argmax), which
the verification treats as deterministic proposals (`workers.engine.speculative`).

The positions the chain writes past the newest token are speculative: the next catch-up starts
again from the newest token, so whatever the verification keeps or rejects, the draft KV that is
read is the KV of the sequence's real tokens. A sequence needs pages for ``k`` positions past its
newest token before it drafts (the step that verifies them needs them too); when the pool cannot
give them it decodes without drafts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from workers.engine.attention import create_attention_backend
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.kv_cache import allocate_kv_cache
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.paged_batch import last_rows, paged_batch
from workers.engine.sampler import argmax
from workers.engine.sequence import Sequence as Seq

logger = logging.getLogger(__name__)


def check_same_tokenizer(target_dir: Path, draft_dir: Path, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's config, once its vocabulary is the target's; else a clear error."""
    draft = ModelConfig.from_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedCheckpointError(
            f"draft model {draft_dir} has a vocabulary of {draft.vocab_size}, the model "
            f"{target.vocab_size}: a draft model must share the tokenizer"
        )
    paths = (target_dir / "tokenizer.json", draft_dir / "tokenizer.json")
    if all(p.is_file() for p in paths):
        vocabs = [json.loads(p.read_text()).get("model", {}).get("vocab") for p in paths]
        if vocabs[0] != vocabs[1]:
            raise UnsupportedCheckpointError(
                f"draft model {draft_dir} has another tokenizer than the model's"
            )
    return draft


class DraftModelDrafter:
    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path,
        target: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
    ) -> None:
        draft_dir = Path(draft_dir)
        config = check_same_tokenizer(Path(target_dir), draft_dir, target)
        self.model, self.config = load_model(draft_dir, dtype, device=device)
        self.page_size = page_size
        self.kv_cache = allocate_kv_cache(config, num_pages, page_size, dtype, device)
        self.backend = create_attention_backend(
            attention_backend, self.kv_cache, page_size, scale=config.attention_scale
        )
        logger.info("draft model %s for speculative decoding", draft_dir)

    @torch.inference_mode()
    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy drafts for each sequence (whose pages reach ``ks[i] - 1``
        positions past its newest token)."""
        # Catch up to the newest token; its logits give the first draft.
        runs = [
            (seq.page_ids, seq.draft_computed, seq.num_tokens - seq.draft_computed) for seq in seqs
        ]
        ids = [t for seq in seqs for t in seq.token_ids[seq.draft_computed :]]
        tokens = self._pass(ids, runs)
        drafts = [[token] for token in tokens]
        for seq in seqs:
            seq.draft_computed = seq.num_tokens
        for step in range(1, max(ks)):
            active = [i for i, k in enumerate(ks) if k > step]
            if not active:
                break
            runs = [(seqs[i].page_ids, seqs[i].num_tokens - 1 + step, 1) for i in active]
            tokens = self._pass([drafts[i][-1] for i in active], runs)
            for i, token in zip(active, tokens, strict=True):
                drafts[i].append(token)
        return drafts

    def _pass(self, ids: list[int], runs: list[tuple[list[int], int, int]]) -> list[int]:
        device = self.kv_cache.device
        positions, batch = paged_batch(runs, self.page_size, device)
        model = self.model
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        hidden = model(input_ids, positions, batch, self.backend)
        logits = model.compute_logits(hidden.index_select(0, last_rows(batch)))
        chosen: list[int] = argmax(logits).tolist()
        return chosen
