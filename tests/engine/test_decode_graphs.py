"""Fixed-shape decode steps (`workers.engine.decode_graphs`): the same tokens as HF.

On CPU the fixed-shape pass runs eagerly (``capture=False``), which is exactly what a CUDA graph
replays; on CUDA the engine captures and replays the graphs themselves (GPU-only test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.attention_cases import make_mixed_case, reference_attention
from tests.engine.engine_helpers import hf_greedy, make_engine, prompts_of_lengths, run_engine
from workers.engine.attention.base import AttentionBatch
from workers.engine.decode_graphs import DecodeGraphs, StaticDecodeAttention
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


@pytest.mark.parametrize("extra_pages", [0, 3])
def test_static_attention_with_padded_rows_and_pages_matches_the_reference(
    extra_pages: int,
) -> None:
    case = make_mixed_case([0, 15, 16, 40, 5], [1, 1, 1, 1, 1])
    before = case.kv_cache.clone()
    real, rows = 5, 8  # three padding rows repeat row 0
    tables = [[p for p in t if p >= 0] for t in case.batch.page_table.tolist()]
    pages = max(len(t) for t in tables) + extra_pages
    padded = [t + [t[0]] * (pages - len(t)) for t in tables]  # no -1: padded with own pages
    pick = list(range(real)) + [0] * (rows - real)
    batch = AttentionBatch(
        query_start_loc=torch.arange(rows + 1),
        seq_lens=case.batch.seq_lens[pick],
        context_lens=case.batch.context_lens[pick],
        page_table=torch.tensor([padded[i] for i in pick]),
        slot_mapping=case.batch.slot_mapping[pick],
        query_lens_list=(1,) * rows,
        seq_lens_list=(pages * 16,) * rows,
    )
    scale = 32**-0.5
    backend = StaticDecodeAttention(case.kv_cache, 16, scale)
    backend.begin_step(batch)
    out = backend.forward(1, case.q[pick], case.k[pick], case.v[pick], batch)
    expected = reference_attention(case, scale)
    torch.testing.assert_close(out[:real].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[real:], out[[0] * (rows - real)])
    # The new tokens' K/V are in their slots, and nothing else changed (the padding rows
    # rewrote row 0's slot with row 0's values).
    slots = case.batch.slot_mapping
    after = case.kv_cache.clone()
    torch.testing.assert_close(after[1, slots // 16, 0, :, slots % 16], case.k, atol=0, rtol=0)
    torch.testing.assert_close(after[1, slots // 16, 1, :, slots % 16], case.v, atol=0, rtol=0)
    after[1, slots // 16, :, :, slots % 16] = before[1, slots // 16, :, :, slots % 16]
    assert torch.equal(after, before)


def test_static_attention_refuses_a_latent_cache() -> None:
    """MLA's single-plane cache (values = keys) runs on the torch backend, never in graphs."""
    with pytest.raises(NotImplementedError, match="MLA latent caches run on the torch backend"):
        StaticDecodeAttention(torch.zeros(1, 4, 1, 1, 16, 8), 16, 1.0)
