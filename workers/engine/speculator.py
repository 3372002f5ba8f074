"""The engine's speculative-decoding step hooks: drafts before a step, verification after it
(the rule and its proof in `workers.engine.speculative`; the drafters in `mtp_drafter` and
`draft_model`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from workers.engine.block_manager import BlockManager
from workers.engine.draft_model import DraftModelDrafter
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.outputs import EngineStats
from workers.engine.scheduler import SchedulerOutput
from workers.engine.sequence import Sequence as Seq
from workers.engine.speculative import (
    MAX_SPEC_BACKOFF,
    SpeculativeConfig,
    accepted_prefix,
    propose_ngram,
)


class Speculator:
    def __init__(
        self,
        spec: SpeculativeConfig,
        block_manager: BlockManager,
        stats: EngineStats,
        max_model_len: int,
        *,
        mtp: MTPDrafter | None = None,
        draft_model: DraftModelDrafter | None = None,
    ) -> None:
        self.spec = spec
        self.block_manager = block_manager
        self.stats = stats
        self.max_model_len = max_model_len
        self.mtp = mtp
        self.draft_model = draft_model

    def propose(self, running: Sequence[Seq], waiting: Iterable[Seq] = ()) -> None:
        """Drafts for every running sequence about to decode, never past its ``max_tokens`` or
        the model length (the step emits up to k + 1); with MTP, also for a decoder's waiting
        requests whose first draft the shipped hidden state gives."""
        spec = self.spec
        candidates = list(running)
        if self.mtp is not None:
            candidates += self._run_shipped_contexts(waiting)
        drafting: list[tuple[Seq, int]] = []  # drafts of a model or an MTP chain, one batch
        for seq in candidates:
            if seq.prefill_only or seq.num_remaining_tokens != 1:
                continue
            if seq.spec_skip:
                seq.spec_skip -= 1
                continue
            room = min(
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            k = min(spec.num_speculative_tokens, room)
            if k <= 0:
                continue
            if spec.method == "mtp":
                # Further drafts chain the module over positions that need pages first.
                if seq.mtp_draft is not None and k > 1 and self._reserve_pages(seq, k):
                    drafting.append((seq, k))
                else:
                    seq.spec_token_ids = [seq.mtp_draft] if seq.mtp_draft is not None else []
            elif spec.method == "draft_model":
                if self._reserve_pages(seq, k):
                    drafting.append((seq, k))
            else:
                seq.spec_token_ids = propose_ngram(
                    seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max
                )
        if drafting:
            if self.mtp is not None:
                proposals = self.mtp.chain(drafting)
            else:
                assert self.draft_model is not None
                seqs, ks = [s for s, _ in drafting], [k for _, k in drafting]
                proposals = self.draft_model.propose(seqs, ks)
            for (seq, _), drafts in zip(drafting, proposals, strict=True):
                seq.spec_token_ids = drafts

    def _run_shipped_contexts(self, waiting: Iterable[Seq]) -> list[Seq]:
        """On a decoder: the module at each new request's last prefilled position, from the
        hidden state the prefill worker shipped (`workers.engine.mtp_drafter`); its prediction
        is the draft of the request's first step. Returns the requests it ran for."""
        work = []
        for seq in waiting:
            if seq.mtp_context is not None:
                if seq.mtp_computed == seq.num_computed_tokens - 1:
                    work.append((seq, seq.mtp_computed, seq.mtp_context))
                seq.mtp_context = None
        if not work:
            return []
        assert self.mtp is not None
        drafts, outputs = self.mtp.run(work)
        for (seq, _, _), draft, output in zip(work, drafts, outputs, strict=True):
            seq.mtp_computed += 1
            seq.mtp_draft, seq.mtp_hidden = draft, output
        return [seq for seq, _, _ in work]

    def _reserve_pages(self, seq: Seq, k: int) -> bool:
        """Pages for the k positions past the newest token, which the verify step computes (and
        the draft chain writes): taken now, or no drafts for the sequence this step."""
        blocks = self.block_manager
        missing = blocks.pages_for_tokens(seq.num_tokens + k) - len(seq.page_ids)
        if missing <= 0:
            return True
        if not blocks.can_allocate(missing):
            return False
        seq.page_ids.extend(blocks.allocate(missing))
        return True

    def verify(self, seq: Seq, drafts: list[int], sampled: list[int]) -> int:
        """How many drafts to keep (those the target agrees with); rolls back the KV of the
        others and counts them."""
        kept = accepted_prefix(drafts, sampled)
        stats = self.stats
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += kept
        per_pos = stats.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(drafts) - len(per_pos)))
        for position in range(kept):
            per_pos[position] += 1
        # A sequence whose text the drafts miss (open-ended generation) stops paying for
        # verifying them: after a step that kept none it proposes again only after 1, 2, 4 ...
        # 16 steps, and at once again after a step that kept one.
        seq.spec_backoff = 0 if kept else min(max(1, 2 * seq.spec_backoff), MAX_SPEC_BACKOFF)
        seq.spec_skip = seq.spec_backoff
        # The step computed the last token and every draft; only the kept drafts' KV is valid
        # (the rejected slots are rewritten by the next step). Pages past what the next step
        # needs (the kept tokens plus the one emitted after them) go back to the pool.
        seq.num_computed_tokens -= len(drafts) - kept
        needed = self.block_manager.pages_for_tokens(seq.num_tokens + kept + 1)
        if len(seq.page_ids) > needed:
            self.block_manager.free(seq.page_ids[needed:])
            del seq.page_ids[needed:]
        return kept

    def after_step(self, scheduled: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """With MTP drafts: run the module over the positions this step computed and kept; its
        prediction at each sequence's newest position is the sequence's next draft."""
        if self.mtp is None:
            return
        assert hidden is not None
        work = []
        row = 0
        for seq, chunk in zip(scheduled.seqs, scheduled.chunks, strict=True):
            first_row, row = row, row + chunk.num_tokens
            seq.mtp_draft = seq.mtp_hidden = None
            kept = seq.num_computed_tokens - chunk.start  # < num_tokens after a rollback
            if seq.is_finished or seq.mtp_computed != chunk.start or kept <= 0:
                continue  # gone, or its MTP KV does not reach this chunk: no drafts
            work.append((seq, chunk.start, hidden[first_row : first_row + kept]))
        if not work:
            return
        drafts, outputs = self.mtp.run(work)
        for (seq, _, _), draft, output in zip(work, drafts, outputs, strict=True):
            seq.mtp_computed = seq.num_computed_tokens
            # Mid-prompt, the prediction is of a prompt token: no draft.
            if seq.num_remaining_tokens == 1:
                seq.mtp_draft, seq.mtp_hidden = draft, output
            else:
                seq.mtp_draft = seq.mtp_hidden = None
