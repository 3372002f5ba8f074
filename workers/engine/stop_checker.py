"""Stop conditions of a sequence after each sampled token, and its incremental text.

Checked in vLLM's order: EOS (unless ``ignore_eos``), stop token ids, stop strings (the text up to,
not including, the stop string is kept), then ``max_tokens`` and ``max_model_len``.
"""

from __future__ import annotations

import logging
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
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None and (self.detokenize or seq.params.stop):
            from workers.engine.tokenizer import IncrementalDetokenizer

            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids
            )

    def forget(self, seq: Sequence) -> None:
        self._detokenizers.pop(seq.request_id, None)

    def check(self, seq: Sequence) -> tuple[str, FinishReason | None]:
        """After ``seq``'s newest token: (new text, finish reason or None)."""
        token_id = seq.token_ids[-1]
        params = seq.params
        new_text = self._push_text(seq, token_id)
        reason = None
        if (
            not params.ignore_eos and token_id in self.eos_token_ids
        ) or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif params.stop and new_text:
            cut = self._find_stop_string(seq, new_text)
            if cut is not None:
                kept = seq.output_text[:cut]
                new_text = kept[len(seq.output_text) - len(new_text) :]
                seq.output_text = kept
                return new_text, FinishReason.STOP
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            new_text += self._flush(seq)
        return new_text, reason

    def _push_text(self, seq: Sequence, token_id: int) -> str:
        detokenizer = self._detokenizers.get(seq.request_id)
        if detokenizer is None:
            return ""
        delta = detokenizer.push(token_id)
        seq.output_text += delta
        return delta

    def _flush(self, seq: Sequence) -> str:
        """Text the detokenizer held back (an incomplete character at the end)."""
        detokenizer = self._detokenizers.get(seq.request_id)
        if detokenizer is None:
            return ""
        tail = detokenizer.flush()
        seq.output_text += tail
        return tail

    @staticmethod
    def _find_stop_string(seq: Sequence, new_text: str) -> int | None:
        """Index in ``seq.output_text`` where the earliest stop string starts, if one ended now."""
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop)
        # Only a stop string overlapping the new text can be new.
        search_from = max(0, len(text) - len(new_text) - longest + 1)
        hits = [i for s in seq.params.stop if (i := text.find(s, search_from)) != -1]
        return min(hits) if hits else None
