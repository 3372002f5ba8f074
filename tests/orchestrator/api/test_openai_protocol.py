"""OpenAI bodies → `GenerationInput`, and the one error mapping of the HTTP edge (no cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.api.http import error_of
from orchestrator.api.openai_protocol import parse_request
from orchestrator.errors import (
    CapacityError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from workers.engine.tokenizer import ByteTokenizer
from workers.service.metrics import failure_label


def test_sampling_fields_map_onto_the_router_input() -> None:
    body = {
        "model": "m",
        "prompt": ["hello"],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "\n",
        "seed": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_request("completion", body, "m", None)
    generation = parsed.generation
    assert generation.prompt == "hello" and generation.prompt_token_ids is None
    assert generation.max_tokens == 7 and generation.return_logprobs
    assert generation.sampling == {
        "temperature": 0.0,
        "top_p": 0.5,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "seed": 3,
        "stop": ["\n"],
    }
    assert parsed.stream and parsed.include_usage and parsed.logprobs


def test_token_id_prompts_and_chat_max_completion_tokens() -> None:
    parsed = parse_request("completion", {"prompt": [[1, 2, 3]]}, "m", None)
    assert parsed.generation.prompt_token_ids == [1, 2, 3]
    tokenizer = ByteTokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 4,
        "max_tokens": 9,
    }
    parsed = parse_request("chat", body, "m", tokenizer)
    assert parsed.generation.prompt_token_ids == list(b"hi")
    assert parsed.generation.max_tokens == 4 and not parsed.include_usage


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"prompt": "x", "n": 2},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "logprobs": 5},
        {"prompt": "x", "echo": True},
        {"prompt": ["a", "b"]},
        {"prompt": [1, "b"]},
        {},
    ],
)
def test_bad_completion_bodies(body: Any) -> None:
    with pytest.raises(InvalidRequestError):
        parse_request("completion", body, "m", None)


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        (
            "completion",
            {"prompt": "x", "temperature": "hot"},
            "temperature must be a number, got 'hot'",
        ),
        (
            "completion",
            {"prompt": "x", "max_tokens": True},
            "max_tokens must be an integer, got True",
        ),
        ("completion", {"prompt": "x", "top_p": 10**400}, "top_p is out of range"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream must be true or false, got 'yes'"),
        ("completion", {"prompt": "x", "stop": 3}, "stop must be a string or a list of strings"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ("completion", {"prompt": "x", "n": 2}, "n must be 1, got 2"),
        ("completion", {}, "prompt must be a non-empty string or list of token ids"),
        ("chat", {}, "messages must be a non-empty list"),
        ("chat", {"messages": [{"content": "x"}]}, "each message needs a role and content"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "message content must be text"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "logprobs": 1}, "logprobs must be"),
        ("completion", [], "the request body must be a JSON object"),
    ],
)
def test_bad_bodies_are_refused_naming_the_key(kind: str, body: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(kind, body, "m", ByteTokenizer())
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("key", ["kv_transfer_params", "prefill_endpoint", "remote_host"])
def test_kv_transfer_keys_are_refused_whatever_their_value(key: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{key}: KV transfers are the router's"):
        parse_request("completion", {"prompt": "x", key: None}, "m", None)


def test_unknown_keys_are_ignored_and_the_model_defaults_to_the_served_one() -> None:
    body = {"prompt": "x", "user": "u1", "metadata": {"a": 1}, "model": "", "stream_options": None}
    parsed = parse_request("completion", body, "served", None)
    assert parsed.model == "served" and not parsed.stream and not parsed.include_usage
    assert parsed.generation.sampling == {"stop": []}


def test_chat_needs_a_template() -> None:
    with pytest.raises(InvalidRequestError, match="chat template"):
        parse_request("chat", {"messages": [{"role": "user", "content": "x"}]}, "m", None)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequestError("bad"), 400, "invalid_request_error"),
        (CapacityError("too long"), 400, "invalid_request_error"),
        (QueueFullError("full"), 429, "rate_limit_error"),
        (UnavailableError("draining"), 503, "service_unavailable"),
        (WorkerFailedError("died"), 503, "service_unavailable"),
        (RuntimeError("secret detail"), 500, "internal_error"),
    ],
)
def test_error_mapping(error: Exception, status: int, kind: str) -> None:
    got_status, body = error_of(error)
    assert got_status == status
    assert body["error"]["type"] == kind and set(body["error"]) >= {"message", "type", "code"}
    assert "secret" not in body["error"]["message"] or status != 500


def test_transfer_failure_reasons_stay_in_the_vocabulary() -> None:
    assert failure_label("deadline") == "deadline"
    assert failure_label("KV write failed: -5") == "fabric_error"
    assert failure_label("prefill worker is shutting down (draining)") == "aborted"
    assert failure_label("???") == "protocol_error"
