"""Greedy tokens of the engine equal HF transformers ``generate`` (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import (
    GREEDY,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    run_engine,
)
from workers.engine.sampling_params import SamplingParams

MIXED_LENGTHS = [1, 2, 7, 16, 17, 50, 128, 300]


@pytest.fixture(scope="module", params=["tiny", "qwen3", "deepseek", "deepseek-v2", "qwen3-moe"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    # Only the parametrised checkpoint is written.
    name = str(request.param).replace("-", "_")
    return Path(request.getfixturevalue(f"{name}_model_dir"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    prompts = prompts_of_lengths(MIXED_LENGTHS)
    return [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]


def test_single_prompts(model_dir: Path, reference: list[list[int]]) -> None:
    engine = make_engine(model_dir)
    prompts = prompts_of_lengths(MIXED_LENGTHS)
    for index in (0, 4, 7):
        assert run_engine(engine, [prompts[index]]) == [reference[index]]


@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_concurrent_batch_with_chunked_prefill(
    model_dir: Path, reference: list[list[int]], budget: int
) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    steps: list[int] = []
    engine.on_step_scheduled = lambda chunks: steps.append(sum(c.num_tokens for c in chunks))
    assert run_engine(engine, prompts_of_lengths(MIXED_LENGTHS)) == reference
    assert max(steps) <= budget
    if budget < 300:
        assert len(steps) > 300 // budget  # the long prompt really was chunked


def test_preemption_by_recompute_keeps_tokens(model_dir: Path, reference: list[list[int]]) -> None:
    # 24 pages of 16 tokens: the 300-token prompt alone needs 20 pages, all 8 need ~45.
    engine = make_engine(model_dir, num_pages=24, max_num_batched_tokens=64)
    assert run_engine(engine, prompts_of_lengths(MIXED_LENGTHS)) == reference
    assert engine.stats.num_preemptions > 0


def test_ignore_eos_runs_to_max_tokens(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (tokens,) = run_engine(engine, prompts_of_lengths([9]), params)
    assert len(tokens) == 12


@pytest.mark.slow
def test_smollm2_greedy_parity(demo_model_dir: Path) -> None:
    from workers.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(demo_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    prompts = [tokenizer.encode(t) for t in texts]
    engine = make_engine(demo_model_dir, num_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    expected = [hf_greedy(demo_model_dir, p, 10) for p in prompts]
    assert run_engine(engine, prompts, params) == expected
