"""OpenAI request bodies → the router's `GenerationInput`, and `StreamEvent`s → OpenAI JSON.

No I/O: `orchestrator.api.http` owns the server. Bodies are read by the models of
`orchestrator.api.openai_bodies`; one that cannot be served raises `InvalidRequestError` (HTTP
400 at the edge), `UnsupportedParameterError` for a feature this server lacks. Nothing else is
checked here that the router checks itself (sampling ranges, prompt length).

Supported: ``prompt`` as text, token ids, or a one-element list of either; ``messages`` with
text content (a string, or ``{"type": "text"}`` parts) rendered by the tokenizer's chat
template; ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``presence_penalty``, ``frequency_penalty``, vLLM's ``top_k`` / ``min_p`` /
``repetition_penalty`` / ``ignore_eos``, ``logprobs`` of the chosen token only; ``n`` = 1.
An explicit ``max_tokens`` must fit ``max_model_len`` with the prompt (OpenAI's rule; the router
checks it, `GenerationInput.max_tokens_within_context`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from orchestrator.api.openai_bodies import (
    TRANSFER_KEYS,
    ChatBody,
    CompletionBody,
    UnsupportedParameterError,
    chat_prompt_ids,
)
from orchestrator.router.types import GenerationInput, StreamEvent
from workers.engine.tokenizer import Tokenizer

__all__ = [
    "TRANSFER_KEYS",
    "ParsedRequest",
    "UnsupportedParameterError",
    "completion_response",
    "model_entry",
    "models_response",
    "parse_request",
    "stream_chunk",
    "usage",
    "usage_chunk",
]


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request: what the router runs and how the answer is shaped."""

    kind: str  # "completion" or "chat"
    model: str
    generation: GenerationInput
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_request(
    kind: str, body: object, served_model: str, tokenizer: Tokenizer | None
) -> ParsedRequest:
    """The body of a ``kind`` request ("completion" or "chat") as the router's input;
    ``served_model`` names the answer of a body that names no model."""
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    parsed: ChatBody | CompletionBody
    if kind == "chat":
        chat = parsed = ChatBody.parse(body)
        prompt_ids = chat_prompt_ids(chat.messages, tokenizer)
        max_tokens = chat.checked_max_tokens(
            chat.max_tokens if chat.max_completion_tokens is None else chat.max_completion_tokens
        )
        logprobs = bool(chat.logprobs)
    else:
        completion = parsed = CompletionBody.parse(body)
        if isinstance(completion.prompt, str):
            prompt = completion.prompt
        else:
            prompt_ids = list(completion.prompt)
        max_tokens = completion.checked_max_tokens(completion.max_tokens)
        logprobs = completion.logprobs is not None
    generation = GenerationInput(
        request_id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        sampling=parsed.sampling(),
        max_tokens=max_tokens,
        max_tokens_within_context=max_tokens is not None,
        return_token_ids=logprobs,
        return_logprobs=logprobs,
    )
    model = parsed.model or served_model
    return ParsedRequest(
        kind, model, generation, parsed.stream is True, parsed.include_usage, logprobs
    )


# --- responses ---------------------------------------------------------------------------


def usage(event: StreamEvent) -> dict[str, int]:
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": event.num_completion_tokens,
        "total_tokens": event.num_prompt_tokens + event.num_completion_tokens,
    }


def _logprobs(
    request: ParsedRequest, events: list[StreamEvent], tokenizer: Tokenizer | None
) -> dict[str, Any] | None:
    if not request.logprobs:
        return None
    ids = [t for e in events for t in e.token_ids]
    values = [v for e in events for v in e.logprobs]
    tokens = [tokenizer.decode([t], skip_special_tokens=False) if tokenizer else "" for t in ids]
    if request.kind == "chat":
        # ``token`` is the token's text as vLLM gives it (U+FFFD for part of a character);
        # ``bytes`` are its own bytes, so a client can join them into that character.
        raw = tokenizer.token_bytes(ids) if tokenizer else [b""] * len(ids)
        content = [
            {"token": t, "logprob": v, "bytes": list(b), "top_logprobs": []}
            for t, b, v in zip(tokens, raw, values, strict=False)
        ]
        return {"content": content}
    return {
        "tokens": tokens,
        "token_logprobs": values,
        # The engine computes the chosen token's logprob only: each position's "top" is it.
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=False)],
        # The router's, from its prompt-seeded detokenizer (`TextStream.take_offsets`).
        "text_offset": [offset for e in events for offset in e.text_offsets],
    }


def _choice(
    request: ParsedRequest,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    delta: bool,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if request.kind == "chat":
        message = {"role": "assistant", "content": text}
        choice["delta" if delta else "message"] = message
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    return choice


def _envelope(request: ParsedRequest, created: int, chunk: bool) -> dict[str, Any]:
    if request.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {
        "id": request.generation.request_id,
        "object": obj,
        "created": created,
        "model": request.model,
    }


def completion_response(
    request: ParsedRequest, events: list[StreamEvent], tokenizer: Tokenizer | None
) -> dict[str, Any]:
    """The whole answer of a non-streaming request (``events``: all of its stream)."""
    last = events[-1]
    text = "".join(e.text for e in events)
    logprobs = _logprobs(request, events, tokenizer)
    body = _envelope(request, int(time.time()), chunk=False)
    body["choices"] = [_choice(request, text, last.finish_reason or None, logprobs, False)]
    body["usage"] = usage(last)
    return body


def stream_chunk(
    request: ParsedRequest,
    event: StreamEvent,
    created: int,
    tokenizer: Tokenizer | None,
) -> dict[str, Any]:
    """One SSE chunk."""
    body = _envelope(request, created, chunk=True)
    logprobs = _logprobs(request, [event], tokenizer)
    body["choices"] = [_choice(request, event.text, event.finish_reason or None, logprobs, True)]
    return body


def usage_chunk(request: ParsedRequest, event: StreamEvent, created: int) -> dict[str, Any]:
    """``stream_options.include_usage``: the last chunk, usage and no choices."""
    body = _envelope(request, created, chunk=True)
    body["choices"] = []
    body["usage"] = usage(event)
    return body


def model_entry(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "pdserve"}


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(model, created)]}
