"""A client's request made ready for a worker, or refused, before anything is allocated: its
prompt as token ids (`prompt_ids`) and its `SamplingParams` after the engine's own checks
(`sampling_params`). Every refusal is an `InvalidRequestError` (INVALID_ARGUMENT)."""

from __future__ import annotations

from orchestrator.errors import ContextLengthError, InvalidRequestError
from orchestrator.router.types import GenerationInput, RouterSettings
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import Tokenizer
from workers.engine.validation import validate_request

MAX_REQUEST_ID_BYTES = 256  # a client's id is echoed in every streamed message and in logs


def check_request_id(request_id: str) -> None:
    """A client's own request id: at most `MAX_REQUEST_ID_BYTES` of printable text."""
    size = len(request_id.encode("utf-8", errors="replace"))
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError(
            f"request_id of {size} bytes exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes"
        )
    if not request_id.isprintable():
        raise InvalidRequestError("request_id must be printable text (no control characters)")


def prompt_ids(
    request: GenerationInput, tokenizer: Tokenizer | None, max_request_bytes: int
) -> list[int]:
    """The prompt's token ids: given, or the tokenized text (at most ``max_request_bytes``)."""
    has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
    if has_text == has_ids:
        raise InvalidRequestError("give exactly one of prompt and prompt_token_ids")
    if has_ids:
        return list(request.prompt_token_ids or [])
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: give prompt_token_ids")
    text = request.prompt or ""
    # Checked before tokenizing: the tokenizer's time grows with the text, and a lone
    # surrogate (JSON can carry one) is no text a tokenizer can take.
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError("the prompt is not valid Unicode text") from None
    if size > max_request_bytes:
        raise InvalidRequestError(
            f"prompt of {size} bytes exceeds the router's limit of {max_request_bytes} bytes "
            "(router.max_request_bytes)"
        )
    return tokenizer.encode(text)


def sampling_params(
    request: GenerationInput,
    request_id: str,
    prompt: list[int],
    settings: RouterSettings,
    has_tokenizer: bool,
) -> SamplingParams:
    """The request's sampling, its max_tokens defaulted to what the context leaves."""
    room = max(1, settings.max_model_len - len(prompt))
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = min(settings.default_max_tokens, room)
    elif request.max_tokens_within_context and len(prompt) + max_tokens > (settings.max_model_len):
        raise ContextLengthError(
            f"this model's maximum context length is {settings.max_model_len} tokens; "
            f"the request asks for {len(prompt) + max_tokens} ({len(prompt)} in the "
            f"prompt, max_tokens {max_tokens})"
        )
    elif max_tokens > settings.max_model_len:
        # No request can ever generate that many; a smaller excess over what the prompt
        # leaves is served and ends with "length" at max_model_len.
        raise InvalidRequestError(
            f"max_tokens {max_tokens} exceeds max_model_len={settings.max_model_len}"
        )
    params = SamplingParams(
        **request.sampling, max_tokens=max_tokens, logprobs=request.return_logprobs
    )
    validate_request(  # the engine's own checks: INVALID_ARGUMENT before any allocation
        request_id,
        prompt,
        params,
        vocab_size=settings.vocab_size,
        max_model_len=settings.max_model_len,
        pool_tokens=settings.pool_tokens,
        has_tokenizer=has_tokenizer,
    )
    return params
