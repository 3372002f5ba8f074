"""OpenAI request bodies → the router's `GenerationInput`, and `StreamEvent`s → OpenAI JSON.

Plain functions over plain dicts, no I/O: `orchestrator.http_api` owns the server. A body that
cannot be served raises `InvalidRequestError` (HTTP 400 at the edge); nothing else is checked
here that the router checks itself (sampling ranges, prompt length).

Supported: ``prompt`` as text, token ids, or a one-element list of either; ``messages`` with
text content (a string, or ``{"type": "text"}`` parts) rendered by the tokenizer's chat
template; ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``presence_penalty``, ``frequency_penalty``, vLLM's ``top_k`` / ``min_p`` /
``repetition_penalty`` / ``ignore_eos``, ``logprobs`` of the chosen token only; ``n`` = 1.
An explicit ``max_tokens`` must fit ``max_model_len`` with the prompt (OpenAI's rule; the router
checks it, `GenerationInput.max_tokens_within_context`).

Other keys are ignored, as OpenAI clients send many optional ones (``user``, ``metadata``, ...),
except those whose meaning would be lost: `TRANSFER_KEYS`, fields that would steer where a
request's KV comes from or goes to (only the router decides that), and features this server
lacks (tools, structured output, ``logit_bias``, ``suffix``: `_refuse_unsupported`). A body
naming one is refused rather than served as if the key were not there.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import InvalidRequestError
from orchestrator.router import GenerationInput, StreamEvent
from workers.engine.tokenizer import Tokenizer

# OpenAI field -> SamplingParams field, with the JSON types accepted.
_NUMBERS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
_INTS = {"seed": "seed", "top_k": "top_k"}
# vLLM's disaggregated-serving key (``kv_transfer_params``) and the parts it is made of, and
# the internal API's field (worker.proto's ``prefill_endpoint``).
TRANSFER_KEYS = (
    "kv_transfer_params",
    "prefill_endpoint",
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)


class UnsupportedParameterError(InvalidRequestError):
    """An OpenAI parameter this server cannot honour (HTTP 400 naming it as ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request: what the router runs and how the answer is shaped."""

    kind: str  # "completion" or "chat"
    model: str
    generation: GenerationInput
    stream: bool
    include_usage: bool
    logprobs: bool


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise InvalidRequestError(f"{name} must be {what}, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")


def _float(name: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float (JSON integers have no size limit)
        raise InvalidRequestError(f"{name} is out of range") from None


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    for name, target in _NUMBERS.items():
        value = _field(body, name, (int, float), "a number")
        if value is not None:
            sampling[target] = _float(name, value)
    for name, target in _INTS.items():
        value = _field(body, name, (int,), "an integer")
        if value is not None:
            sampling[target] = value
    if _field(body, "ignore_eos", (bool,), "true or false"):
        sampling["ignore_eos"] = True
    sampling["stop"] = _stop(body)
    return sampling


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_ids(prompt):
        prompt = prompt[0]  # ["text"] or [[ids]]: one prompt
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if isinstance(prompt, list) and _is_token_ids(prompt):
        return None, list(prompt)
    raise InvalidRequestError(
        "prompt must be a non-empty string or list of token ids (one prompt per request)"
    )


def _message_text(message: object) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"each message needs a role and content, got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"message content must be text, got {content!r}")
    try:  # JSON may carry a lone surrogate ("\ud800"), which no tokenizer takes
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("message content is not valid Unicode text") from None
    return {"role": message["role"], "content": content}


def chat_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer | None) -> list[int]:
    """The chat template of the tokenizer over ``messages``, as token ids (the template
    writes the special tokens itself, so none are added again)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    if tokenizer is None or not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template([_message_text(m) for m in messages])
    except InvalidRequestError:
        raise
    except Exception as error:  # the template's own raise_exception(), bad roles
        raise InvalidRequestError(f"chat template: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Refuse the features this server lacks unless their value asks for nothing (a client
    relying on one would otherwise get an answer that silently ignored it)."""
    for name in ("tools", "functions"):
        if body.get(name):
            raise UnsupportedParameterError(name, "tool and function calling are not supported")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise UnsupportedParameterError(name, "only 'none' and 'auto' are supported")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise UnsupportedParameterError(
            "response_format", "only {'type': 'text'} is supported (no JSON mode or schema)"
        )
    if body.get("logit_bias"):
        raise UnsupportedParameterError("logit_bias", "not supported")
    if body.get("suffix"):
        raise UnsupportedParameterError("suffix", "not supported (no insertion)")


def parse_request(
    kind: str, body: object, served_model: str, tokenizer: Tokenizer | None
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    transfer = [key for key in TRANSFER_KEYS if key in body]
    if transfer:
        raise InvalidRequestError(
            f"{', '.join(transfer)}: KV transfers are the router's to arrange; "
            "a client cannot set them"
        )
    _refuse_unsupported(body)
    n = _field(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise InvalidRequestError(f"n must be 1, got {n}")
    if _field(body, "best_of", (int,), "an integer") not in (None, 1):
        raise InvalidRequestError("best_of must be 1")
    if _field(body, "echo", (bool,), "true or false"):
        raise InvalidRequestError("echo is not supported")
    model = _field(body, "model", (str,), "a string") or served_model
    stream = bool(_field(body, "stream", (bool,), "true or false"))
    options = _field(body, "stream_options", (dict,), "an object") or {}
    include_usage = stream and bool(options.get("include_usage"))
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    if kind == "chat":
        prompt_ids = chat_prompt_ids(body, tokenizer)
        max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
        logprobs = bool(_field(body, "logprobs", (bool,), "true or false"))
        if _field(body, "top_logprobs", (int,), "an integer"):
            raise InvalidRequestError("top_logprobs is not supported (chosen tokens only)")
    else:
        prompt, prompt_ids = _prompt(body)
        max_tokens = None
        number = _field(body, "logprobs", (int,), "an integer")
        if number is not None and number > 1:
            raise InvalidRequestError("logprobs > 1 is not supported (chosen tokens only)")
        logprobs = number is not None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
    generation = GenerationInput(
        request_id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        sampling=_sampling(body),
        max_tokens=max_tokens,
        max_tokens_within_context=max_tokens is not None,
        return_token_ids=logprobs,
        return_logprobs=logprobs,
    )
    return ParsedRequest(kind, model, generation, stream, include_usage, logprobs)


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
