"""Per-request sampling parameters (vLLM semantics), validated at construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.errors import InvalidRequestError

# Temperatures below this are greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# Stop conditions one request may carry. Every stop string is matched against the text after
# every token, and the router holds back as many characters as the longest one, so both the
# count and the length bound per-token work; OpenAI allows 4 stop strings, these leave room for
# templates that need a few more. Stop token ids are a set lookup: the bound only caps memory.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 256
# Integer fields travel as protobuf int32 / uint64 on the router's path to a worker.
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a count to a caller)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature: 0 means greedy. top_k: 0 or -1 disables it. top_p: 1 disables it.
    min_p: drop tokens whose probability is below ``min_p * max probability``; 0 disables it.
    repetition_penalty: > 1 discourages tokens seen in the prompt or the output (positive
        logits divided, negative multiplied); 1 disables it.
    presence_penalty / frequency_penalty: subtracted once per token present in the output /
        once per occurrence in the output; 0 disables them.
    stop: strings that end the output (the stop string itself is not part of the text); at
        most ``MAX_STOP_STRINGS``, each non-empty and at most ``MAX_STOP_STRING_BYTES`` in UTF-8.
    stop_token_ids: at most ``MAX_STOP_TOKEN_IDS``.
    seed: in [0, 2**64); top_k and max_tokens: at most 2**31 - 1.
    logprobs: report the log-probability of each chosen token (from the model's raw logits).
    ignore_eos and logprobs must be bools, and no other field takes a bool.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling params: {message}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            # bool is an int subclass: True would pass as 1 and hide a caller's mix-up.
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise bad(f"{name} must be a finite number, got {value!r}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            raise bad(f"top_k must be -1, 0 (disabled) or in [1, 2**31), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= _INT32_MAX:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        self._check_stop(bad)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _UINT64_MAX):
            raise bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    def _check_stop(self, bad: Callable[[str], InvalidRequestError]) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for stop in self.stop:
            try:
                size = len(stop.encode("utf-8"))
            except UnicodeEncodeError:
                raise bad(f"stop string {stop!r} is not valid Unicode text") from None
            if size > MAX_STOP_STRING_BYTES:
                raise bad(
                    f"a stop string is at most {MAX_STOP_STRING_BYTES} bytes, got one of {size}"
                )
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
