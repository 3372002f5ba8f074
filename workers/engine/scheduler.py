"""Continuous batching with chunked prefill under a per-step token budget.

Queues:

- ``waiting``: sequences with KV still to compute and no place in the batch yet (new requests,
  preempted ones at the front). FIFO.
- ``running``: sequences admitted to the batch; they hold pages. Each step every running
  sequence gets either its next prefill chunk or its one decode token, budget permitting.

A step's work for a sequence is ``num_computed_tokens .. num_computed_tokens + n``. Every chunk
but the last of a sequence's pending tokens ends on a page boundary, so each page is written
exactly once per layer (the KV messenger counts writes per page in advance).

When a running sequence needs a page and none is free, the most recently admitted running
sequence is preempted by recompute: its pages go back to the pool and it rejoins the front of
``waiting`` with nothing computed. Pinned pages belong to no running sequence and so are never
taken; but they are reserved only until their transfer lands, fails or times out, so a sequence
that does not fit only because of them waits (preempted, or first in ``waiting``) instead of
being finished. Only a sequence that outgrows the whole pool is finished (``length``). On the
prefill role a sequence gets all its pages when admitted, so it is never preempted (its KV is
already on its way to a decoder).

Prefix caching (``enable_prefix_caching``): a sequence admitted with nothing computed first
takes the longest run of named pages matching its tokens (`BlockManager.lookup`) and starts
computing after them; every page a step fills is named (`postprocess`), and so are the pages of
a decoder's prefilled request when it is admitted (`name_computed_pages`). Preempted sequences
benefit too: their pages stay cached until something needs the room. A decoder also looks up a
prompt before it asks for its KV (`acquire_prefix`), so only the rest is transferred.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.prefix_cache import cache_salt, extend_page_hashes
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's work in one step, as the KV messenger sees it.

    ``start .. end`` are token positions whose KV this step writes; ``page_ids`` are the pages
    holding those positions (``page_ids[0]`` holds position ``start``; ``start`` is always on a
    page boundary except for a decode token).
    """

    request_id: str
    start: int
    end: int
    page_ids: tuple[int, ...]
    samples: bool  # the step samples a token for this sequence

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences finished because they outgrew the whole KV pool (reason ``length``).
    hopeless: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, cache_name: str = ""
    ) -> None:
        """``cache_name``: what the pool's KV depends on besides tokens, dtype and page size
        (the checkpoint), salted into page identities."""
        self.config = config
        self.block_manager = block_manager
        self.page_size = config.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.caching = config.enable_prefix_caching
        self.salt = cache_salt(cache_name, config.dtype, config.page_size)
        # Prefix cache counters in tokens (vLLM's names): looked up at admission, found cached.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_prompt_work(self) -> bool:
        """A request waits for admission, or a running one has prompt tokens left to compute."""
        return bool(self.waiting) or any(
            seq.num_computed_tokens < seq.num_prompt_tokens for seq in self.running
        )

    # --- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running sequences first: they already hold pages, and finishing them frees pages.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = self._chunk_size(seq, budget)
            if num_new == 0:
                index += 1
                continue
            if not self._fits_alone(seq, num_new):
                self.finish(seq, FinishReason.LENGTH)
                out.hopeless.append(seq)
                continue
            while not self._can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: it was the last running sequence
            self._schedule(seq, num_new, out)
            budget -= num_new
            index += 1

        # Admit waiting sequences only when nobody was preempted: they would just be evicted.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            cached = self._take_cached_prefix(seq)
            num_new = self._chunk_size(seq, budget)
            if num_new == 0:
                self._give_back_prefix(seq, cached)
                break
            # The prefill role reserves a prompt's pages at admission, so it never preempts:
            # a recomputed chunk would send its pages to the decoder a second time.
            reserve = seq.num_remaining_tokens if seq.prefill_only else num_new
            if not self._fits_alone(seq, reserve):
                self.finish(seq, FinishReason.LENGTH)
                out.hopeless.append(seq)
                continue
            if not self._can_append(seq, reserve) and not self._drop_waiting_kv(seq, reserve, out):
                self._give_back_prefix(seq, cached)
                break
            self.waiting.popleft()
            if cached is not None:
                self.count_query(seq.num_tokens, cached)
            seq.start_running()
            self.running.append(seq)
            seq.page_ids.extend(self.block_manager.allocate(self._pages_needed(seq, reserve)))
            self._schedule(seq, num_new, out)
            budget -= num_new

        return out

    def postprocess(self, out: SchedulerOutput) -> None:
        """Account this step's computed tokens (before the engine appends sampled tokens)."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            if self.caching:
                self._name_full_pages(seq, num_new)

    def finish(self, seq: Sequence, reason: FinishReason, *, keep_pages: bool = False) -> None:
        """End a sequence in any state; frees its pages unless the caller still needs them."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason)
        if not keep_pages:
            self.release_pages(seq)

    def release_pages(self, seq: Sequence) -> None:
        self.block_manager.free(seq.page_ids)
        seq.page_ids = []

    # --- prefix caching --------------------------------------------------------------------

    def page_names(self, token_ids: list[int]) -> list[bytes]:
        """The names of the full pages of ``token_ids`` in this pool."""
        return extend_page_hashes([], token_ids, self.page_size, len(token_ids), self.salt)

    def acquire_prefix(
        self, hashes: list[bytes], token_ids: list[int], max_pages: int
    ) -> list[int]:
        """Share the cached pages of the longest cached prefix of ``token_ids`` (at most
        ``max_pages`` pages) with one more owner; ``hashes``: the tokens' chain so far, extended
        in place."""
        names = extend_page_hashes(hashes, token_ids, self.page_size, max_pages, self.salt)
        pages = self.block_manager.lookup(names[:max_pages])
        self.block_manager.acquire(pages)
        return pages

    def count_query(self, num_tokens: int, num_cached_pages: int) -> None:
        """A lookup of ``num_tokens`` that found ``num_cached_pages`` (counted in tokens)."""
        self.num_prefix_cache_queries += num_tokens
        self.num_prefix_cache_hits += num_cached_pages * self.page_size

    def name_computed_pages(self, seq: Sequence) -> None:
        """Name every full page of a sequence admitted with its KV computed elsewhere (a
        decoder's prefilled request)."""
        if self.caching:
            self._name_pages(seq, 0, seq.num_computed_tokens // self.page_size)

    def _take_cached_prefix(self, seq: Sequence) -> int | None:
        """Give a sequence with nothing computed the cached pages of its longest cached prefix;
        returns how many pages it got, None when the cache was not asked (caching off, or KV
        already computed). The last token's KV is always computed: its logits sample the next
        token. On the prefill role the last token is the decoder's, and the one before it is
        computed for the hidden state the decoder is sent."""
        if not self.caching or seq.num_computed_tokens or seq.page_ids:
            return None
        last = seq.num_tokens - (2 if seq.prefill_only else 1)
        pages = self.acquire_prefix(seq.page_hashes, seq.token_ids, max(last, 0) // self.page_size)
        seq.page_ids = pages
        seq.num_computed_tokens = len(pages) * self.page_size
        return len(pages)

    def _give_back_prefix(self, seq: Sequence, cached: int | None) -> None:
        """Undo `_take_cached_prefix` for a sequence that stays waiting."""
        if cached:
            self.release_pages(seq)
            seq.num_computed_tokens = 0

    def name_kept_drafts(self, seq: Sequence, kept: list[int]) -> None:
        """Name the pages that a verify step's ``kept`` drafts (not yet appended to ``seq``)
        filled: `postprocess` names pages of the sequence's own tokens only, since it runs
        before the drafts are judged."""
        first = seq.num_tokens // self.page_size
        full = (seq.num_tokens + len(kept)) // self.page_size
        if self.caching and full > first:  # copy the token list only when a page filled
            self._name_pages(seq, first, full, seq.token_ids + kept)

    def _name_full_pages(self, seq: Sequence, num_new: int) -> None:
        """Name the pages this step filled with the sequence's own tokens (their KV is
        complete); pages holding drafts wait for their verdict (`name_kept_drafts`)."""
        first = (seq.num_computed_tokens - num_new) // self.page_size
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.page_size
        self._name_pages(seq, first, full)

    def _name_pages(
        self, seq: Sequence, first: int, full: int, token_ids: list[int] | None = None
    ) -> None:
        if full <= first:
            return
        tokens = seq.token_ids if token_ids is None else token_ids
        names = extend_page_hashes(seq.page_hashes, tokens, self.page_size, full, self.salt)
        for index in range(first, full):
            self.block_manager.register(seq.page_ids[index], names[index])

    # --- helpers ---------------------------------------------------------------------------

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to run this step within ``budget``; 0 when none fit."""
        if seq.spec_token_ids and seq.num_remaining_tokens > budget:
            seq.spec_token_ids = []  # drafts are verified whole or not at all
        remaining = seq.num_remaining_tokens
        if remaining <= budget:
            return remaining
        if not self.config.enable_chunked_prefill:
            return 0
        # Not the last chunk: end on a page boundary.
        end = (seq.num_computed_tokens + budget) // self.page_size * self.page_size
        return max(end - seq.num_computed_tokens, 0)

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        total = self.block_manager.pages_for_tokens(seq.num_computed_tokens + num_new)
        return max(total - len(seq.page_ids), 0)

    def _can_append(self, seq: Sequence, num_new: int) -> bool:
        return self.block_manager.can_allocate(self._pages_needed(seq, num_new))

    def _schedule(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        seq.page_ids.extend(self.block_manager.allocate(self._pages_needed(seq, num_new)))
        start = seq.num_computed_tokens
        end = start + num_new
        first_page = start // self.page_size
        last_page = (end - 1) // self.page_size
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        out.chunks.append(
            ScheduledChunk(
                request_id=seq.request_id,
                start=start,
                end=end,
                page_ids=tuple(seq.page_ids[first_page : last_page + 1]),
                samples=not seq.prefill_only and end == seq.num_tokens + len(seq.spec_token_ids),
            )
        )

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (recompute)", seq.request_id)
        self.running.remove(seq)
        self.release_pages(seq)
        seq.preempt()
        self.waiting.appendleft(seq)

    def _drop_waiting_kv(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """With nothing running, free KV held by waiting sequences queued behind ``seq``.

        Only the decode role has waiting sequences that hold pages (KV written by a prefill
        worker). If they hold every free page, nothing running will ever free one: drop the KV
        of the newest of them (they recompute it later) until ``seq`` fits. Drop none when all
        of them would not make room (pinned pages block ``seq``): ``seq`` waits for those either
        way, and the dropped KV would only have to be recomputed.
        """
        if self.running:
            return False  # running sequences will finish or be preempted and free pages
        needed = self._pages_needed(seq, num_new)
        num_reclaimable = self.block_manager.num_free_pages
        victims: list[Sequence] = []
        for victim in reversed(self.waiting):
            if num_reclaimable >= needed:
                break
            if victim is not seq and victim.page_ids:
                victims.append(victim)
                # A shared page returns to the pool only with its last owner.
                num_reclaimable += sum(
                    1 for p in victim.page_ids if self.block_manager.ref_count(p) == 1
                )
        if num_reclaimable < needed:
            return False
        for victim in victims:
            logger.debug("dropping the KV of waiting %s (recompute)", victim.request_id)
            self.release_pages(victim)
            victim.drop_kv()
            out.preempted.append(victim)
        return self._can_append(seq, num_new)

    def _fits_alone(self, seq: Sequence, num_new: int) -> bool:
        """Whether the pages ``seq`` needs fit in the whole pool.

        A sequence that does not can never run (preempting others would not help): the
        scheduler finishes it with ``length`` rather than preempting forever. Pinned pages do
        not count against it: each is freed or handed to a request once its transfer lands,
        fails or passes its deadline, after which preemption (or dropping waiting KV) can
        reclaim it, so a sequence they block only waits.
        """
        needed = self.block_manager.pages_for_tokens(seq.num_computed_tokens + num_new)
        return needed <= self.block_manager.num_pages
