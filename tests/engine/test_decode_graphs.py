"""Fixed-shape decode steps (`workers.engine.decode_graphs`): the same tokens as HF.

On CPU the fixed-shape pass runs eagerly (``capture=False``), which is exactly what a CUDA graph
replays; on CUDA the engine captures and replays the graphs themselves (GPU-only test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import hf_greedy, make_engine, prompts_of_lengths, run_engine
from workers.engine.decode_graphs import DecodeGraphs
from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams

# Around page boundaries (16-token pages), a long prompt, and 1-token prompts.
LENGTHS = [1, 2, 15, 16, 17, 50, 300]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20)


def install(engine: EngineCore, max_batch: int) -> DecodeGraphs:
    graphs = DecodeGraphs(
        engine.model,
        engine.kv_cache,
        engine.config.page_size,
        engine.layer_progress,
        scale=engine.model_config.head_dim**-0.5,
        max_batch=max_batch,
        max_model_len=engine.max_model_len,
        capture=False,
    )
    assert engine.tp is None
    engine.runner.decode_graphs = graphs
    return graphs


@pytest.fixture(scope="module", params=["tiny", "qwen3", "qwen2"])
def model_dir(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    qwen3_model_dir: Path,
    qwen2_model_dir: Path,
) -> Path:
    return {"tiny": tiny_model_dir, "qwen3": qwen3_model_dir, "qwen2": qwen2_model_dir}[
        request.param
    ]


@pytest.mark.parametrize("budget", [64, 2048])
def test_fixed_shape_decode_matches_hf(model_dir: Path, budget: int) -> None:
    prompts = prompts_of_lengths(LENGTHS)
    reference = [hf_greedy(model_dir, p, PARAMS.max_tokens) for p in prompts]
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    graphs = install(engine, max_batch=8)
    assert run_engine(engine, prompts, PARAMS) == reference
    # Seven sequences padded to eight rows, then fewer as they finish; with budget 64 the long
    # prompt's chunks make the first steps mixed (the regular path).
    assert graphs.steps >= PARAMS.max_tokens - 1


def test_steps_that_do_not_fit_run_on_the_regular_path(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64)
    graphs = install(engine, max_batch=2)
    prompts = prompts_of_lengths([5, 6, 7])
    reference = [hf_greedy(tiny_model_dir, p, 8) for p in prompts]
    assert run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8)) == reference
    assert graphs.steps == 0  # three sequences decode together: more than max_batch
    assert (
        run_engine(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8))
        == (reference[:2])
    )
    assert graphs.steps == 7  # the first token comes from the prompt's step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_hf_on_cuda(tiny_model_dir: Path) -> None:
    prompts = prompts_of_lengths(LENGTHS)
    reference = [hf_greedy(tiny_model_dir, p, PARAMS.max_tokens, device="cuda") for p in prompts]
    engine = make_engine(tiny_model_dir, device="cuda", max_num_batched_tokens=64)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    assert run_engine(engine, prompts, PARAMS) == reference
    assert graphs.steps >= PARAMS.max_tokens - 1
    assert graphs.graphs  # captured, and replayed by the later steps of each shape
