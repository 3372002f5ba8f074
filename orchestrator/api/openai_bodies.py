"""OpenAI request bodies as pydantic models: `CompletionBody` (``/v1/completions``) and
`ChatBody` (``/v1/chat/completions``), read with strict JSON types (``max_tokens: true`` or
``"7"`` is refused, not coerced). A body that cannot be served raises `InvalidRequestError`
naming the key (HTTP 400 at the edge; `orchestrator.api.openai_protocol` turns a body into the
router's input).

Other keys are ignored, as OpenAI clients send many optional ones (``user``, ``metadata``, ...),
except those whose meaning would be lost: `TRANSFER_KEYS`, fields that would steer where a
request's KV comes from or goes to (only the router decides that), and features this server
lacks (tools, structured output, ``logit_bias``, ``suffix``: `_refuse_unsupported`, raising
`UnsupportedParameterError`). A body naming one is refused rather than served as if the key were
not there.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from orchestrator.errors import InvalidRequestError
from workers.engine.tokenizer import Tokenizer

# OpenAI field -> SamplingParams field (the same names).
_NUMBERS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
)
_INTS = ("seed", "top_k")
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


# Pydantic error type -> what the key must be (`_invalid`).
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "an object",
    "list_type": "a list",
    "model_type": "an object",
}


def _invalid(exc: ValidationError) -> InvalidRequestError:
    """The first of pydantic's errors as the `InvalidRequestError` naming its key."""
    error: ErrorDetails = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):  # raised by a validator below, as it is
        return cause
    name = ".".join(str(part) for part in error["loc"])
    value = error.get("input")
    if error["type"] == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return InvalidRequestError(f"{name} is out of range")  # an integer beyond any float
    expected = _EXPECTED.get(error["type"])
    if expected is None:
        return InvalidRequestError(f"{name}: {error['msg']}")
    return InvalidRequestError(f"{name} must be {expected}, got {value!r}")


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


class _Body(BaseModel):
    """What both endpoints read. Keys not declared here are ignored, but for the refused ones
    (`TRANSFER_KEYS`, `_refuse_unsupported`); null stands for a key left out."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    model: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop: list[str] = []

    @classmethod
    def parse(cls, body: object) -> Self:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise _invalid(exc) from None

    @model_validator(mode="before")
    @classmethod
    def _refused_keys(cls, body: Any) -> Any:
        if isinstance(body, dict):
            transfer = [key for key in TRANSFER_KEYS if key in body]
            if transfer:
                raise InvalidRequestError(
                    f"{', '.join(transfer)}: KV transfers are the router's to arrange; "
                    "a client cannot set them"
                )
            _refuse_unsupported(body)
        return body

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return list(stop)
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")

    @model_validator(mode="after")
    def _one_choice(self) -> Self:
        if self.n not in (None, 1):
            raise InvalidRequestError(f"n must be 1, got {self.n}")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of must be 1")
        if self.echo:
            raise InvalidRequestError("echo is not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream) and bool((self.stream_options or {}).get("include_usage"))

    def sampling(self) -> dict[str, Any]:
        """The `SamplingParams` fields the body sets."""
        sampling: dict[str, Any] = {}
        for name in (*_NUMBERS, *_INTS):
            value = getattr(self, name)
            if value is not None:
                sampling[name] = value
        if self.ignore_eos:
            sampling["ignore_eos"] = True
        sampling["stop"] = list(self.stop)
        return sampling

    def checked_max_tokens(self, max_tokens: int | None) -> int | None:
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
        return max_tokens


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class CompletionBody(_Body):
    """A ``/v1/completions`` body."""

    # Required, with the validator's own words when absent (hence the validated default).
    prompt: str | list[int] = Field(default=None, validate_default=True)
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: object) -> object:
        if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_ids(prompt):
            prompt = prompt[0]  # ["text"] or [[ids]]: one prompt
        if (isinstance(prompt, str) and prompt) or _is_token_ids(prompt):
            return prompt
        raise InvalidRequestError(
            "prompt must be a non-empty string or list of token ids (one prompt per request)"
        )

    @model_validator(mode="after")
    def _chosen_token_only(self) -> Self:
        if self.logprobs is not None and self.logprobs > 1:
            raise InvalidRequestError("logprobs > 1 is not supported (chosen tokens only)")
        return self


class ChatMessage(BaseModel):
    """One chat message, its content as text (text parts joined; null is empty)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    role: str
    content: str

    @model_validator(mode="before")
    @classmethod
    def _role_and_text(cls, message: Any) -> Any:
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


class ChatBody(_Body):
    """A ``/v1/chat/completions`` body."""

    # Required, with the validator's own words when absent (hence the validated default).
    messages: list[ChatMessage] = Field(default=None, validate_default=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _some_messages(cls, messages: object) -> object:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        return messages

    @model_validator(mode="after")
    def _chosen_token_only(self) -> Self:
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported (chosen tokens only)")
        return self


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer | None) -> list[int]:
    """The chat template of the tokenizer over ``messages``, as token ids (the template
    writes the special tokens itself, so none are added again)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template([m.model_dump() for m in messages])
    except Exception as error:  # the template's own raise_exception(), bad roles
        raise InvalidRequestError(f"chat template: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)
