"""Bad requests, configs and checkpoints raise typed errors and leave the pool untouched."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.engine_helpers import GREEDY, THREE_TOKENS, drain, make_engine
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.errors import CapacityError, InvalidRequestError, UnsupportedCheckpointError
from workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> EngineCore:
    return make_engine(tiny_model_dir, num_pages=8, max_model_len=256)


def _bad_calls() -> dict[str, Callable[[EngineCore], object]]:
    vocab = 320  # the presets' padded vocabulary
    return {
        "empty prompt": lambda e: e.add_request("a", [], GREEDY),
        "prompt at max_model_len": lambda e: e.add_request("a", [1] * 256, GREEDY),
        "token id negative": lambda e: e.add_request("a", [1, -1], GREEDY),
        "token id past vocab": lambda e: e.add_request("a", [1, vocab + 5], GREEDY),
        "token id not an int": lambda e: e.add_request("a", [1, 2.0], GREEDY),  # type: ignore[list-item]
        "text instead of ids": lambda e: e.add_request("a", "hello", GREEDY),  # type: ignore[arg-type]
        "params not SamplingParams": lambda e: e.add_request("a", [1], {"max_tokens": 3}),  # type: ignore[arg-type]
        "empty request id": lambda e: e.add_request("", [1], GREEDY),
        "stop token past vocab": lambda e: e.add_request(
            "a", [1], SamplingParams(stop_token_ids=[vocab])
        ),
        "unpinned pages": lambda e: e.add_prefilled_request("a", [1, 2, 3], GREEDY, [0]),
        "too few pages": lambda e: e.add_prefilled_request("a", [1] * 40, GREEDY, []),
        "kv_ready unknown": lambda e: e.kv_ready("nope"),
        "release unknown": lambda e: e.release("nope"),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_request_raises_before_allocating(engine: EngineCore, case: str) -> None:
    free_before = engine.block_manager.num_free_pages
    with pytest.raises(InvalidRequestError):
        _bad_calls()[case](engine)
    assert engine.block_manager.num_free_pages == free_before
    assert not engine.has_unfinished()
    engine.check_invariants()


def test_duplicate_active_request_id(engine: EngineCore) -> None:
    engine.add_request("dup", [1, 2, 3], GREEDY)
    free_before = engine.block_manager.num_free_pages
    with pytest.raises(InvalidRequestError, match="already active"):
        engine.add_request("dup", [4, 5], GREEDY)
    assert engine.block_manager.num_free_pages == free_before
    while engine.has_unfinished():
        engine.step()
    engine.add_request("dup", [4, 5], GREEDY)  # reusable once finished
    engine.abort("dup")
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_pages == engine.num_pages


def test_id_is_refused_until_its_abort_output_is_out(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_pages=64, page_size=4)
    engine.add_request("X", [1, 2, 3, 4, 5], THREE_TOKENS)
    engine.step()
    assert engine.abort("X")
    with pytest.raises(InvalidRequestError, match="still ending; its final output comes"):
        engine.add_request("X", [9, 9, 9], THREE_TOKENS)
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == 64  # nothing allocated for the refused one

    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("X", "abort")]
    engine.add_request("X", [9, 9, 9], THREE_TOKENS)  # the old X is gone: the id is free again
    assert drain(engine) == {"X": "length"}


def test_decode_role_id_is_refused_while_its_abort_output_is_pending(
    tiny_model_dir: Path,
) -> None:
    engine = make_engine(tiny_model_dir, role="decode", num_pages=16, page_size=4)
    prompt = list(range(1, 10))
    engine.add_request_awaiting_kv("X", prompt, GREEDY)
    assert engine.abort("X")
    pinned = engine.allocate_pinned(engine.num_prefill_pages(len(prompt)))
    with pytest.raises(InvalidRequestError, match="still ending"):
        engine.add_request_awaiting_kv("X", prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match="still ending"):
        engine.add_prefilled_request("X", prompt, GREEDY, pinned)
    assert all(engine.block_manager.is_pinned(p) for p in pinned)  # not handed over
    assert engine.block_manager.num_pinned_pages == len(pinned)
    engine.check_invariants()
    assert drain(engine) == {"X": "abort"}
    engine.add_prefilled_request("X", prompt, THREE_TOKENS, pinned)
    assert drain(engine) == {"X": "length"}


def test_prompt_larger_than_the_pool_is_a_capacity_error(tiny_model_dir: Path) -> None:
    small = make_engine(tiny_model_dir, num_pages=2, max_model_len=256)
    with pytest.raises(CapacityError):
        small.add_request("a", [1] * 40, GREEDY)
    assert small.block_manager.num_free_pages == 2 and not small.has_unfinished()


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0}, {"top_p": 2.0}, {"top_k": -5}],
)
def test_bad_sampling_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 5}, "logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": True}, "top_k"),
        ({"seed": False}, "seed"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
    ],
)
def test_sampling_values_of_the_wrong_type(kwargs: dict[str, object], field: str) -> None:
    # bool is an int subclass in Python; a flag given as a number (or a count as a flag) is a
    # caller's mistake, not a value to reinterpret.
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"role": "both"},
        {"page_size": 12},
        {"num_pages": 10, "kv_memory_bytes": 1 << 20},
        {"num_pages": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 8, "page_size": 16},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
        {"dtype": "int8"},
        {"attention_backend": "magic"},
    ],
)
def test_bad_config_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_unsupported_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError):
        EngineCore(tmp_path / "missing", EngineConfig(num_pages=4))
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match="unsupported architecture"):
        EngineCore(gpt2, EngineConfig(num_pages=4))


def test_no_chunked_prefill_budget_is_checked_against_the_model_limit(
    tiny_model_dir: Path,
) -> None:
    # max_model_len left to the model (2048 for the preset): without chunked prefill a prompt
    # longer than the step budget would pass validation and then never be scheduled.
    config = EngineConfig(num_pages=64, max_num_batched_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineCore(tiny_model_dir, config)
