"""Request state: plain data plus an explicit state machine.

::

    WAITING_FOR_KV ──kv_ready──▶ WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED
          │                        ▲                  │
          │                        └────preempt───────┘   (pages freed, KV recomputed later)
          └──────────────abort──────────────────────────────────────▶ FINISHED

WAITING_FOR_KV exists only on the decode role: the request holds *pinned* pages that a prefill
worker is writing into; it is invisible to the scheduler until its KV is complete. Any state may
go to FINISHED on abort.

``num_computed_tokens`` counts tokens whose KV is in the sequence's pages. A sequence has work
while ``num_computed_tokens < target_num_computed``; it samples a token in a step that brings
``num_computed_tokens`` to ``num_tokens`` (never on the prefill role, whose target is all prompt
tokens but the last).
"""

from __future__ import annotations

import enum
import time

import torch

from workers.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill role: KV of all prompt tokens but the last is complete


_ALLOWED = {
    SequenceStatus.WAITING_FOR_KV: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.FINISHED: set(),
}


class IllegalTransitionError(RuntimeError):
    pass


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        status: SequenceStatus = SequenceStatus.WAITING,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.prefill_only = prefill_only
        self.status = status
        self.num_computed_tokens = 0
        self.page_ids: list[int] = []
        # Speculative decoding: draft tokens the next step runs after ``token_ids`` and
        # verifies (`workers.engine.speculative`); not part of the sequence until kept.
        self.spec_token_ids: list[int] = []
        # Back-off after verification kept no draft: steps to skip proposing, and the length
        # of the last back-off (doubling while drafts keep failing).
        self.spec_skip = 0
        self.spec_backoff = 0
        # MTP drafts (`workers.engine.mtp_drafter`): positions whose MTP KV is written, the
        # module's prediction of the token after the newest (None: none yet) and its output
        # there, which further drafts chain from.
        self.mtp_computed = 0
        self.mtp_draft: int | None = None
        self.mtp_hidden: torch.Tensor | None = None
        # On a decoder: the main model's hidden state at position ``mtp_computed``, shipped by
        # the prefill worker; the module runs it before the first step (then None).
        self.mtp_context: torch.Tensor | None = None
        # Draft-model drafts (`workers.engine.draft_model`): positions whose draft KV is valid.
        self.draft_computed = 0
        # Prefix caching: the chained names of the first full pages of ``token_ids``
        # (`workers.engine.prefix_cache`); tokens never change, so neither do these.
        self.page_hashes: list[bytes] = []
        self.arrival_time = time.perf_counter()
        self.token_times: list[float] = []
        self.logprobs: list[float] = []
        self.output_text = ""
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    # --- derived ---------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def target_num_computed(self) -> int:
        """Tokens whose KV must be computed before the sequence is done with this phase."""
        return self.num_prompt_tokens - 1 if self.prefill_only else self.num_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens to run: those not computed yet, then any drafts to verify."""
        return self.target_num_computed + len(self.spec_token_ids) - self.num_computed_tokens

    def step_token_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions ``start .. end``, drafts after the sequence's own."""
        if not self.spec_token_ids:
            return self.token_ids[start:end]
        return (self.token_ids + self.spec_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- transitions -----------------------------------------------------------------------

    def _move(self, new: SequenceStatus) -> None:
        if new not in _ALLOWED[self.status]:
            raise IllegalTransitionError(
                f"request {self.request_id}: {self.status.value} -> {new.value} is not allowed"
            )
        self.status = new

    def kv_ready(self) -> None:
        self._move(SequenceStatus.WAITING)

    def start_running(self) -> None:
        self._move(SequenceStatus.RUNNING)

    def preempt(self) -> None:
        """Back to WAITING; the caller frees the pages, whose KV will be recomputed."""
        self._move(SequenceStatus.WAITING)
        self.page_ids = []
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.mtp_computed, self.mtp_draft, self.draft_computed = 0, None, 0
        self.mtp_context = self.mtp_hidden = None
        self.num_preemptions += 1

    def drop_kv(self) -> None:
        """A WAITING sequence loses its KV (the caller freed the pages); recomputed later."""
        if self.status is not SequenceStatus.WAITING:
            raise IllegalTransitionError(f"request {self.request_id}: drop_kv while {self.status}")
        self.page_ids = []
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.mtp_computed, self.mtp_draft, self.draft_computed = 0, None, 0
        self.mtp_context = self.mtp_hidden = None
        self.num_preemptions += 1

    def finish(self, reason: FinishReason) -> None:
        self._move(SequenceStatus.FINISHED)
        self.finish_reason = reason
        self.spec_token_ids = []

    def append_token(self, token_id: int, logprob: float | None, when: float) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(when)
        if logprob is not None:
            self.logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, pages={len(self.page_ids)})"
        )
