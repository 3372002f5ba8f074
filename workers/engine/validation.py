"""Checks a request must pass before the engine allocates anything for it."""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.errors import CapacityError, InvalidRequestError
from workers.engine.sampling_params import SamplingParams


def validate_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    pool_tokens: int,
    has_tokenizer: bool,
) -> list[int]:
    """Return the prompt as a list of ints, or raise ``InvalidRequestError`` / ``CapacityError``.

    ``pool_tokens``: how many tokens the whole KV pool holds.
    """
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
        raise InvalidRequestError("prompt_token_ids must be a sequence of token ids")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError(f"request {request_id}: empty prompt")
    for token_id in prompt:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidRequestError(f"request {request_id}: token id {token_id!r} is not an int")
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"request {request_id}: token id {token_id} outside the vocabulary [0, {vocab_size})"
            )
    # The prompt must leave room for at least one output token.
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"request {request_id}: prompt of {len(prompt)} tokens does not fit "
            f"max_model_len={max_model_len} with room for one output token"
        )
    for token_id in params.stop_token_ids:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                f"request {request_id}: stop token id {token_id} outside the vocabulary"
            )
    if params.stop and not has_tokenizer:
        raise InvalidRequestError(
            f"request {request_id}: stop strings need a tokenizer; the checkpoint has none"
        )
    if len(prompt) + 1 > pool_tokens:
        raise CapacityError(
            f"request {request_id}: prompt of {len(prompt)} tokens does not fit the KV pool "
            f"({pool_tokens} tokens) even when it is empty"
        )
    return prompt
