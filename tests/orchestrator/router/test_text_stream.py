"""Router-side detokenization (`TextStream`): text deltas, stop strings, where each token
starts in the answer, and which tokens add no text (a stop token id's, as in the engine)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from orchestrator.router.text_stream import TextStream
from orchestrator.router.types import GenerationInput
from tests.orchestrator.harness import GREEDY, mixed_router
from workers.engine.tokenizer import ByteTokenizer
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer


def _push_text(stream: TextStream, text: str) -> str:
    out = ""
    for byte in text.encode():
        stream.push(byte)
        out += stream.take()
    return out + stream.take(final=True)


def test_text_stream_without_stop_strings_passes_everything() -> None:
    assert _push_text(TextStream(ByteTokenizer(), [1, 2], []), "héllo wörld") == "héllo wörld"


def test_text_stream_cuts_at_the_earliest_stop_string_and_holds_back_its_prefix() -> None:
    stream = TextStream(ByteTokenizer(), [1], ["END", "xy"])
    sent = ""
    for byte in b"abcEN":
        stream.push(byte)
        sent += stream.take()
    assert sent == "abc"  # "EN" is held back: it may start "END"
    stream.push(ord("D"))
    assert stream.stopped and stream.take() == ""
    assert stream.text == "abc"


def test_text_stream_releases_held_text_at_the_end() -> None:
    assert _push_text(TextStream(ByteTokenizer(), [1], ["END"]), "abcEN") == "abcEN"


def _offsets(stream: TextStream, ids: list[int]) -> list[int]:
    for token_id in ids:
        stream.push(token_id)
    return stream.take_offsets()


def test_text_offsets_are_where_each_token_starts_in_the_answer() -> None:
    stream = TextStream(ByteTokenizer(), list(b"x"), ())
    ids = list("héllo".encode())  # "é" is two byte tokens: both start at its character
    assert _offsets(stream, ids[:2]) + _offsets(stream, ids[2:]) == [0, 1, 1, 2, 3, 4]
    cut = TextStream(ByteTokenizer(), list(b"x"), ["lo"])  # a stop string cuts "lo" off
    assert _offsets(cut, list(b"hello")) == [0, 1, 2, 3, 3]
    assert cut.take(final=True) == "hel"


def test_a_stop_token_ids_text_is_not_output(
    mixed_worker: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    """An ordinary token named in ``stop_token_ids`` ends the request, is streamed as an id,
    and adds no text: the text equals that of the same request cut before it by max_tokens."""

    async def run() -> None:
        router = mixed_router(tiny_model_dir, mixed_worker[1].address)

        async def generate(max_tokens: int, **sampling: Any) -> tuple[str, list[int], str]:
            request = GenerationInput(
                prompt="hello world",
                sampling={**GREEDY, **sampling},
                max_tokens=max_tokens,
                return_token_ids=True,
            )
            events = [event async for event in router.generate(request)]
            ids = [token for event in events for token in event.token_ids]
            return "".join(event.text for event in events), ids, events[-1].finish_reason

        _, ids, _ = await generate(12)
        # The first output token not seen before it: the request stops there, not earlier.
        cut = next(i for i, token in enumerate(ids) if i >= 3 and token not in ids[:i])
        expected_text, _, _ = await generate(cut)
        text, stopped_ids, reason = await generate(12, stop_token_ids=[ids[cut]])
        assert (stopped_ids, reason) == (ids[: cut + 1], "stop")
        assert text == expected_text
        await router.close()

    asyncio.run(run())
