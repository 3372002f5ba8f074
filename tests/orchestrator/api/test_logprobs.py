"""Logprobs in OpenAI's shapes: completions' ``text_offset`` from the router and the chosen
token as ``top_logprobs``; chat's ``bytes``, each token's own (also for part of a character)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.api.openai_protocol import completion_response, parse_request, stream_chunk
from orchestrator.router.types import StreamEvent, Timings
from workers.engine.tokenizer import ByteTokenizer, load_tokenizer


def _event(text: str, ids: list[int], offsets: list[int], reason: str = "") -> StreamEvent:
    return StreamEvent("cmpl-1", text, ids, [-0.5] * len(ids), reason, text_offsets=offsets)


def test_completion_logprobs_carry_the_routers_offsets_and_the_chosen_token_as_top() -> None:
    tokenizer = ByteTokenizer()
    request = parse_request("completion", {"prompt": "x", "logprobs": 1}, "m", tokenizer)
    ids = list("héllo".encode())
    answer = completion_response(
        request, [_event("héllo", ids, [0, 1, 1, 2, 3, 4], "length")], tokenizer
    )
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 1, 1, 2, 3, 4]
    assert logprobs["top_logprobs"] == [{t: -0.5} for t in logprobs["tokens"]]
    chunk = stream_chunk(request, _event("lo", ids[4:], [3, 4], "length"), 0, tokenizer)
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [3, 4]


@pytest.mark.parametrize("text", ["é", "日本 😀", "a b"])
def test_chat_logprob_bytes_are_each_tokens_own_bytes(tiny_model_dir: Path, text: str) -> None:
    """The preset's byte-level BPE tokens are single bytes: most of a character's tokens hold
    part of it, which decodes to U+FFFD alone."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    parsed = parse_request("chat", body, "tiny", tokenizer)
    event = StreamEvent(
        parsed.generation.request_id,
        text,
        ids,
        [-0.5] * len(ids),
        "stop",
        3,
        len(ids),
        Timings(0.0, 0.0, 0.0, 0.0),
    )
    content = completion_response(parsed, [event], tokenizer)["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    # ``token`` stays the token's text, as vLLM gives it.
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in ids]


def test_token_bytes_of_both_tokenizers(tiny_model_dir: Path) -> None:
    text = "é 日本 😀 a"
    for tokenizer in (load_tokenizer(tiny_model_dir), ByteTokenizer()):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tokenizer.token_bytes(ids)) == text.encode()
        assert tokenizer.token_bytes([256]) == [b"<s>"]  # a special token: its text
