"""The offline ``LLM`` API: prompts in any form, results with text, tokens, reasons, times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import hf_greedy
from workers.engine import LLM, SamplingParams
from workers.engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, num_pages=128, max_num_batched_tokens=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_prompt_forms_and_result_fields(llm: LLM, tiny_model_dir: Path) -> None:
    text = "Hello, world"
    ids = llm.tokenizer.encode(text)
    (from_text,) = llm.generate(text, GREEDY)
    (from_ids,) = llm.generate(ids, GREEDY)
    both = llm.generate([text, ids, [5, 6, 7]], GREEDY)
    assert len(both) == 3
    assert from_text.prompt_token_ids == ids
    assert from_text.token_ids == from_ids.token_ids == both[0].token_ids == both[1].token_ids
    assert from_text.token_ids == hf_greedy(tiny_model_dir, ids, 6)
    assert from_text.finish_reason == "length" and len(from_text.token_ids) == 6
    assert from_text.text == llm.tokenizer.decode(from_text.token_ids)
    times = from_text.token_times
    assert len(times) == 6 and times == sorted(times) and times[0] >= from_text.arrival_time
    assert from_text.ttft is not None and from_text.mean_inter_token_latency is not None


def test_stop_string_truncates_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate("abc", params)
    index, char = next((i, c) for i, c in enumerate(full.text) if i > 0 and c != "\ufffd")
    index = full.text.index(char)
    (stopped,) = llm.generate(
        "abc", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[char])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:index]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_request_outgrowing_the_pool_keeps_its_held_back_text(tiny_model_dir: Path) -> None:
    """8 pages of 4 tokens: the request ends ``length`` at 32 tokens. A stop string that never
    matches holds back its last 9 characters; they must still reach the text."""
    with LLM(tiny_model_dir, num_pages=8, page_size=4, max_model_len=256) as small:
        params = SamplingParams(
            temperature=0.0, max_tokens=100, ignore_eos=True, stop=["zzzzzzzzzz"]
        )
        (result,) = small.generate([[65, 66, 67, 68]], params)
        assert result.finish_reason == "length" and len(result.token_ids) < 100
        assert result.text == small.tokenizer.decode(result.token_ids)
        assert len(result.text) >= 9  # long enough that the held-back tail matters
        small.engine.check_invariants()


def _printable_run(token_ids: list[int], length: int) -> int:
    """Index of the first ``length`` consecutive printable ASCII tokens (byte vocabulary)."""
    return next(
        i
        for i in range(len(token_ids) - length + 1)
        if all(32 <= t < 127 for t in token_ids[i : i + length])
    )


def test_stop_string_spanning_tokens_is_not_in_text(llm: LLM) -> None:
    # Its first character arrives a token before the match: the text deltas must hold it back.
    prompt = list(b"hello world")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(prompt, params)
    start = _printable_run(full.token_ids, 2)
    stop = bytes(full.token_ids[start : start + 2]).decode()
    (stopped,) = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    # A stop string that starts but never completes: everything held back is released.
    never = stop[0] + "\x00never"
    (unstopped,) = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[never])
    )
    assert unstopped.finish_reason == "length" and unstopped.text == full.text


def test_stop_token_text_is_not_in_text(llm: LLM) -> None:
    # vLLM (include_stop_str_in_output=False): the stop token id is reported, its text is not.
    prompt = list(b"hello world")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(prompt, params)
    stop_at = full.token_ids[_printable_run(full.token_ids, 1)]
    (stopped,) = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_at]),
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    assert not stopped.text.endswith(chr(stop_at))


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    (full,) = llm.generate(
        [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    stop_at = full.token_ids[3]
    first = full.token_ids.index(stop_at)
    (stopped,) = llm.generate(
        [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[: first + 1]
    eos = llm.engine.stop_checker.eos_token_ids
    assert eos, "the preset declares an EOS token"


def test_seeded_sampling_is_reproducible_and_logprobs_reported(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, logprobs=True)
    a = llm.generate(["x", "y"], [params, SamplingParams(temperature=1.0, max_tokens=8)])
    b = llm.generate("x", params)
    assert a[0].token_ids == b[0].token_ids
    assert len(a[0].logprobs) == len(a[0].token_ids) and all(lp <= 0 for lp in a[0].logprobs)
    assert a[1].logprobs == []


def test_bad_prompt_leaves_the_engine_clean(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", []], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_pages == llm.engine.num_pages
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b"], [GREEDY])
