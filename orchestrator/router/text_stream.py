"""Incremental detokenization of one request's output, with stop strings, on the router.

Workers stream token ids only; the router turns them into text deltas. Stop strings follow the
engine's rule (`workers.engine.stop_checker`): the earliest stop string ends the output and is
not part of the text. While stop strings are set, the last ``len(longest stop) - 1`` characters
are held back, since they may turn out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(
        self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        )
        self._stop = list(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._num_sent = 0
        self.stopped = False
        # Where each token pushed since the last `take_offsets` starts in `text` (OpenAI's
        # completions ``text_offset``), read off this prompt-seeded detokenizer.
        self._offsets: list[int] = []

    def push(self, token_id: int) -> None:
        """Add one output token (the engine's stop tokens included: they decode to nothing)."""
        self._offsets.append(len(self.text))
        if self._detokenizer is None or self.stopped:
            return
        self.text += self._detokenizer.push(token_id)
        self._find_stop()

    def take_offsets(self) -> list[int]:
        """The start of each token pushed since the last call, in characters of the answer;
        within the text (a token after a stop string starts where the text ends)."""
        offsets, self._offsets = self._offsets, []
        return [min(offset, len(self.text)) for offset in offsets]

    def take(self, *, final: bool = False) -> str:
        """Text ready to send; ``final`` releases everything held back."""
        if final and not self.stopped and self._detokenizer is not None:
            self.text += self._detokenizer.flush()
            self._find_stop()
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        if end <= self._num_sent:
            return ""
        delta = self.text[self._num_sent : end]
        self._num_sent = end
        return delta

    def _find_stop(self) -> None:
        if not self._stop:
            return
        hits = [i for s in self._stop if (i := self.text.find(s, self._num_sent)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True


def text_token_ids(
    token_ids: Sequence[int], reason: str, params: SamplingParams, eos_token_ids: Collection[int]
) -> Sequence[int]:
    """The delta's tokens whose text is output: as in the engine (`StopChecker`, vLLM), a token
    that stopped the request as EOS (``eos_token_ids``: none with ``ignore_eos``) or as a stop
    token id adds none (the id is still streamed). A stop string's last token is pushed:
    `TextStream` cuts the string off."""
    if reason != "stop" or not token_ids:
        return token_ids
    last = token_ids[-1]
    stops = last in params.stop_token_ids or last in eos_token_ids
    return token_ids[:-1] if stops else token_ids
