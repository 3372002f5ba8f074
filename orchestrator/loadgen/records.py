"""What one request saw on the client side, and the latency definitions built on it.

Times are seconds from the run's start (one monotonic clock). A streamed message that carries
``k`` tokens arrives once: it contributes one inter-token gap (since the previous token-carrying
message) and ``k - 1`` zero gaps, as vLLM's ``benchmark_serving`` counts them, so that ITL is
per token even when the router coalesces tokens into one message. The first message's tokens
end TTFT (its ``k - 1`` extra tokens add zero gaps too). TPOT = (E2E - TTFT) / (tokens - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    index: int
    warmup: bool
    scheduled_s: float  # the open-loop arrival time
    prompt_tokens: int
    max_tokens: int
    sent_s: float = 0.0  # when the call was made (later than scheduled_s only under the cap)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per message
    finish_s: float | None = None  # the end of the stream (set for completed requests only)
    finish_reason: str = ""
    usage_completion_tokens: int | None = None  # the server's own count, when it sent one
    error: str | None = None  # gRPC status name, "HTTP 503", "stream: ...": counted, not dropped
    # The answer's token ids (the gRPC client; a multi-turn run's next prompt extends them).
    token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def ttft(self) -> float | None:
        for arrival, k in self.chunks:
            if k:
                return arrival - self.sent_s
        return None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.sent_s

    @property
    def itls(self) -> list[float]:
        """Per-token gaps after the first token (see the module docstring)."""
        gaps: list[float] = []
        previous: float | None = None
        for arrival, k in self.chunks:
            if not k:
                continue
            if previous is None:
                gaps.extend([0.0] * (k - 1))
            else:
                gaps.append(arrival - previous)
                gaps.extend([0.0] * (k - 1))
            previous = arrival
        return gaps

    @property
    def last_token_s(self) -> float | None:
        arrivals = [arrival for arrival, k in self.chunks if k]
        return arrivals[-1] if arrivals else None

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "warmup": self.warmup,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "usage_completion_tokens": self.usage_completion_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "chunks": [[round(t, 6), k] for t, k in self.chunks],
        }
