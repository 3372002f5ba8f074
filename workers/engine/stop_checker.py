"""Stop conditions of a sequence after each sampled token, and its incremental text.

Checked in vLLM's order: EOS (unless ``ignore_eos``), stop token ids, stop strings (the text up to,
not including, the stop string is kept), then ``max_tokens`` and ``max_model_len``.

Text follows vLLM (``include_stop_str_in_output=False``): a token that stops the sequence as EOS
or a stop token id stays in ``token_ids`` but adds no text, and a stop string is cut off. The
text deltas a sequence reports concatenate exactly to its final text: while stop strings are set,
the last ``len(longest stop string) - 1`` characters are held back (vLLM's stop buffer), since
they may turn out to be the start of a stop string, and released once they cannot be or when
the sequence finishes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.engine.model_config import ModelConfig
from workers.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


def try_load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (token ids in, token ids out)."""
    from workers.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.warning(
            "no usable tokenizer in %s (%s): text and stop strings disabled", model_dir, exc
        )
        return None


@dataclass
class _TextState:
    """Incremental text of one sequence; ``seq.output_text`` is the text so far."""

    detokenizer: IncrementalDetokenizer
    num_held: int  # trailing characters that may be the start of a stop string
    num_sent: int = 0  # characters of ``seq.output_text`` already reported


class StopChecker:
    def __init__(
        self,
        model_dir: str | Path,
        model_config: ModelConfig,
        max_model_len: int,
        detokenize: bool,
    ) -> None:
        self.tokenizer = try_load_tokenizer(model_dir)
        self.max_model_len = max_model_len
        self.detokenize = detokenize and self.tokenizer is not None
        eos = set(model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._texts: dict[str, _TextState] = {}

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None and (self.detokenize or seq.params.stop):
            from workers.engine.tokenizer import IncrementalDetokenizer

            num_held = max((len(s) for s in seq.params.stop), default=1) - 1
            self._texts[seq.request_id] = _TextState(
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids), num_held
            )

    def forget(self, seq: Sequence) -> None:
        self._texts.pop(seq.request_id, None)

    def check(self, seq: Sequence) -> tuple[str, FinishReason | None]:
        """After ``seq``'s newest token: (new text, finish reason or None)."""
        token_id = seq.token_ids[-1]
        params = seq.params
        reason = None
        if (
            not params.ignore_eos and token_id in self.eos_token_ids
        ) or token_id in params.stop_token_ids:
            reason = FinishReason.STOP  # the stopping token's text is never added
        elif self._add_text(seq, self._push(seq, token_id)):
            return self._take(seq, final=True), FinishReason.STOP
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None and self._add_text(seq, self._flush(seq)):
            reason = FinishReason.STOP
        return self._take(seq, final=reason is not None), reason

    def finish_text(self, seq: Sequence) -> tuple[str, bool]:
        """Text not yet reported of a sequence ended outside `check` (it outgrew the KV pool):
        the held-back tail and the detokenizer's leftover, as `check` releases them on a finish;
        True when that leftover completed a stop string (the finish becomes ``stop``)."""
        stopped = self._add_text(seq, self._flush(seq))
        return self._take(seq, final=True), stopped

    def _push(self, seq: Sequence, token_id: int) -> str:
        state = self._texts.get(seq.request_id)
        return state.detokenizer.push(token_id) if state is not None else ""

    def _flush(self, seq: Sequence) -> str:
        """Text the detokenizer held back (an incomplete character at the end)."""
        state = self._texts.get(seq.request_id)
        return state.detokenizer.flush() if state is not None else ""

    def _add_text(self, seq: Sequence, new_text: str) -> bool:
        """Append ``new_text``; True when it completed a stop string (the text is cut there)."""
        seq.output_text += new_text
        if not (seq.params.stop and new_text):
            return False
        cut = self._find_stop_string(seq, new_text)
        if cut is None:
            return False
        # Never before what was already reported: a stop string reaches at most
        # len(longest) - 1 characters back from the new text, all of them held back.
        seq.output_text = seq.output_text[:cut]
        return True

    def _take(self, seq: Sequence, *, final: bool) -> str:
        """Text not yet reported; all of it when ``final``, else all but the held-back tail."""
        state = self._texts.get(seq.request_id)
        if state is None:
            return ""
        text = seq.output_text
        end = len(text) if final else len(text) - state.num_held
        if end <= state.num_sent:  # nothing past the held-back tail yet
            return ""
        delta = text[state.num_sent : end]
        state.num_sent = end
        return delta

    @staticmethod
    def _find_stop_string(seq: Sequence, new_text: str) -> int | None:
        """Index in ``seq.output_text`` where the earliest stop string starts, if one ended now."""
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop)
        # Only a stop string overlapping the new text can be new.
        search_from = max(0, len(text) - len(new_text) - longest + 1)
        hits = [i for s in seq.params.stop if (i := text.find(s, search_from)) != -1]
        return min(hits) if hits else None
