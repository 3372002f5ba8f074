"""OpenAI request parameters the HTTP front reads (`orchestrator.api.openai_protocol`):
unsupported ones refused with a 400 naming them, values that ask for nothing accepted, and
which ``max_tokens`` must fit the context."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.api.http import error_of
from orchestrator.api.openai_protocol import UnsupportedParameterError, parse_request
from workers.engine.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("completion", {"logit_bias": {"5": -100}}, "logit_bias"),
        ("completion", {"suffix": "the end"}, "suffix"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(
    kind: str, fields: dict[str, Any], param: str
) -> None:
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(UnsupportedParameterError) as caught:
        parse_request(kind, body, "m", ByteTokenizer())
    status, error = error_of(caught.value)
    assert status == 400 and error["error"]["param"] == param
    assert error["error"]["type"] == "invalid_request_error" and param in error["error"]["message"]


def test_values_that_ask_for_nothing_are_accepted() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "suffix": None,
    }
    assert parse_request("chat", body, "m", ByteTokenizer()).generation.prompt_token_ids
    parse_request("chat", {**body, "tool_choice": "auto"}, "m", ByteTokenizer())


def test_only_an_explicit_max_tokens_must_fit_the_context() -> None:
    explicit = parse_request("completion", {"prompt": "hi", "max_tokens": 3}, "m", None)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    assert explicit.generation.max_tokens_within_context
    assert parse_request("chat", chat, "m", ByteTokenizer()).generation.max_tokens_within_context
    omitted = parse_request("completion", {"prompt": "hi"}, "m", None)
    assert not omitted.generation.max_tokens_within_context
