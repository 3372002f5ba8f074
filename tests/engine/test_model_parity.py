"""Our model over the paged cache reproduces HF transformers' float32 logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.model_helpers import (
    PagedRunner,
    hf_logits,
    random_tokens,
    write_attention_bias_checkpoint,
)
from workers.engine.loader import load_model

ATOL = 1e-4


@pytest.fixture(
    params=[
        "tiny_model_dir",
        "qwen3_model_dir",
        "qwen2_model_dir",
        "deepseek_model_dir",
        "deepseek_v2_model_dir",
        "qwen3_moe_model_dir",
    ],
    ids=["llama", "qwen3", "qwen2-bias", "deepseek-v3", "deepseek-v2", "qwen3-moe"],
)
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


def test_single_pass_matches_hf(model_dir: Path) -> None:
    tokens = random_tokens(37, seed=1)
    model, config = load_model(model_dir)
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    expected = hf_logits(model_dir, tokens)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "preset", ["tiny", "qwen3-tiny", "qwen2-tiny"], ids=["llama", "qwen3", "qwen2"]
)
def test_attention_bias_matches_hf(preset: str, tmp_path: Path) -> None:
    """``attention_bias: true``: HF's Llama and Qwen3 give o_proj a bias too, Qwen2 does not."""
    model_dir = write_attention_bias_checkpoint(preset, tmp_path)
    model, config = load_model(model_dir)
    assert config.o_proj_bias is (preset != "qwen2-tiny")
    tokens = random_tokens(37, seed=3)
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    torch.testing.assert_close(ours, hf_logits(model_dir, tokens), atol=ATOL, rtol=0)


def test_two_chunks_equal_one_pass(tiny_model_dir: Path) -> None:
    tokens = random_tokens(45, seed=2)
    model, config = load_model(tiny_model_dir)
    [whole] = PagedRunner(model, config).step([(0, tokens)])
    runner = PagedRunner(model, config)
    # 20 is not page aligned: the second chunk starts mid-page and reads the prefix from cache.
    [first] = runner.step([(0, tokens[:20])])
    [rest] = runner.step([(0, tokens[20:])])
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "fixture", ["qwen3_model_dir", "deepseek_model_dir", "qwen3_moe_model_dir"]
)
def test_mixed_batch_matches_per_sequence_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    """Two prefill chunks (one with cached context, one fresh) and three decode tokens in one step."""
    model_dir = Path(request.getfixturevalue(fixture))
    model, config = load_model(model_dir)
    seqs = {i: random_tokens(n, seed=10 + i) for i, n in enumerate([30, 41, 17, 5, 60])}
    runner = PagedRunner(model, config, page_size=8)
    # Step 1: seq 0 prefills its first 12 tokens, seqs 2, 3, 4 prefill all but their last token.
    runner.step([(0, seqs[0][:12]), (2, seqs[2][:-1]), (3, seqs[3][:-1]), (4, seqs[4][:-1])])
    # Step 2: mixed. seq 0 finishes its prompt (context 12), seq 1 is new, 2/3/4 decode one token.
    chunks = [
        (2, seqs[2][-1:]),
        (0, seqs[0][12:]),
        (3, seqs[3][-1:]),
        (1, seqs[1]),
        (4, seqs[4][-1:]),
    ]
    outputs = runner.step(chunks)
    for (seq_id, new_tokens), ours in zip(chunks, outputs, strict=True):
        expected = hf_logits(model_dir, seqs[seq_id])[-len(new_tokens) :]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0, msg=f"sequence {seq_id}")


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "deepseek_model_dir"])
def test_batched_decode_steps_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    """Several decode steps over sequences of different lengths (pages partly filled)."""
    tiny_model_dir = Path(request.getfixturevalue(fixture))
    model, config = load_model(tiny_model_dir)
    seqs = {i: random_tokens(n, seed=20 + i) for i, n in enumerate([9, 33, 16])}
    num_decode = 4
    runner = PagedRunner(model, config)
    runner.step([(i, toks[:-num_decode]) for i, toks in seqs.items()])
    decoded: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    for k in range(num_decode, 0, -1):
        outs = runner.step([(i, [toks[-k]]) for i, toks in seqs.items()])
        for i, out in zip(seqs, outs, strict=True):
            decoded[i].append(out[0])
    for i, toks in seqs.items():
        expected = hf_logits(tiny_model_dir, toks)[-num_decode:]
        torch.testing.assert_close(torch.stack(decoded[i]), expected, atol=ATOL, rtol=0)


def test_bfloat16_model_tracks_float32(tiny_model_dir: Path) -> None:
    tokens = random_tokens(24, seed=3)
    model32, config = load_model(tiny_model_dir)
    model16, _ = load_model(tiny_model_dir, "bfloat16")
    assert model16.embed_tokens.dtype == torch.bfloat16
    [ref] = PagedRunner(model32, config).step([(0, tokens)])
    [low] = PagedRunner(model16, config).step([(0, tokens)])
    assert low.dtype == torch.float32
    # Same argmax almost everywhere and small relative error: a real bf16 run, not garbage.
    agreement = (low.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agreement >= 0.8
    assert (low - ref).abs().mean().item() < 0.1 * ref.abs().mean().item()
