"""The running set of a decode or mixed instance with speculative decoding, as the engine
runs it (`workers.engine.speculator`):

- a sequence about to decode gets ``min(k, tokens it has left - 1)`` drafts (never past its
  ``max_tokens``), unless it is backing off; the drafts of a sequence the step's token budget
  cannot take whole are dropped, never split;
- the step verifies them in the same pass as its newest token and emits ``1 + kept`` tokens,
  ``kept`` drawn from the acceptance profile (`speculative.SpecDecoding.draws`);
- a verification that kept nothing makes the sequence skip drafting for 1, then 2, 4 ... up
  to `speculative.MAX_SPEC_BACKOFF` steps; one that kept a draft resets that;
- with MTP drafts, after the step the module runs over every position the step computed and
  kept (``1 + kept`` per sequence) in one pass, whose prediction is each sequence's first
  draft; a sequence with more drafts chains the module once per further draft before the
  next step (`DecodeWork.num_mtp_tokens` / ``num_mtp_passes`` price both with the step).
"""

from __future__ import annotations

from orchestrator.sim.batch import DecodeWork, SimRequest
from orchestrator.sim.speculative import MAX_SPEC_BACKOFF, SpecDecoding


class _Sequence:
    __slots__ = (
        "backoff",
        "context",
        "drafts",
        "draws",
        "kept",
        "remaining",
        "request",
        "skip",
        "verified",
    )

    def __init__(self, request: SimRequest, context: int, remaining: int, draws: list[int]):
        self.request = request
        self.context = context  # KV tokens before the token it feeds next
        self.remaining = remaining  # tokens it has still to emit
        self.draws = draws  # drafts kept at each of its verifications (of all k drafts)
        self.verified = 0  # verifications so far: the index of its next draw
        self.backoff = self.skip = 0
        self.drafts = self.kept = 0  # of the planned step


class SpecDecodeSet:
    """``seed``: of the acceptance draws; ``mtp``: whether drafts come from MTP passes."""

    def __init__(self, spec: SpecDecoding, seed: int, mtp: bool) -> None:
        self.spec, self.seed, self.mtp = spec, seed, mtp
        self._sequences: list[_Sequence] = []

    def __len__(self) -> int:
        return len(self._sequences)

    def join(self, request: SimRequest, step: int, base_context: int, num_tokens: int) -> None:
        if request.emitted is None:
            request.emitted = []
        # A verification emits at least one token: num_tokens draws are enough.
        draws = self.spec.draws(self.seed, request.spec.request_id, num_tokens).tolist()
        self._sequences.append(_Sequence(request, base_context, num_tokens, draws))

    def plan(self, step: int, budget: int) -> DecodeWork:
        k = self.spec.k
        room = budget - len(self._sequences)  # rows left for drafts
        kv = drafts = attention = kept_positions = chained = longest_chain = 0
        for seq in self._sequences:
            seq.drafts = seq.kept = 0
            if seq.skip:
                seq.skip -= 1
            else:
                seq.drafts = min(k, seq.remaining - 1)
                if seq.drafts > room:
                    seq.drafts = 0
            if seq.drafts:
                room -= seq.drafts
                seq.kept = min(seq.draws[seq.verified], seq.drafts)
            n, c = seq.drafts, seq.context + 1  # c: positions its newest token attends to
            kv += c
            drafts += n
            attention += n * c + n * (n + 1) // 2
            kept_positions += 1 + seq.kept
            if n > 1:
                chained += n - 1
                longest_chain = max(longest_chain, n - 1)
        if not self.mtp or not self._sequences:
            return DecodeWork(len(self._sequences), kv, drafts, attention)
        return DecodeWork(
            len(self._sequences),
            kv,
            drafts,
            attention,
            kept_positions + chained,
            1 + longest_chain,
        )

    def finish(self, step: int) -> list[SimRequest]:
        done, running = [], []
        for seq in self._sequences:
            emitted = 1 + seq.kept
            seq.context += emitted
            seq.remaining -= emitted
            assert seq.request.emitted is not None
            seq.request.emitted.append(emitted)
            if seq.drafts:
                seq.verified += 1
                if seq.kept:
                    seq.backoff = seq.skip = 0
                else:
                    seq.backoff = min(max(1, 2 * seq.backoff), MAX_SPEC_BACKOFF)
                    seq.skip = seq.backoff
            if seq.remaining:
                running.append(seq)
            else:
                done.append(seq.request)
        self._sequences = running
        return done
