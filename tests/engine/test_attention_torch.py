"""The torch attention backend against dense attention, plus the backend factory."""

from __future__ import annotations

import pytest
import torch

from tests.engine.attention_cases import make_mixed_case, reference_attention
from workers.engine.attention import create_attention_backend
from workers.engine.attention.torch_backend import TorchAttentionBackend

CASES = {
    # (cached context lengths, new token counts) per sequence
    "prefill-only": ([0, 0], [23, 16]),
    "decode-only": ([0, 15, 16, 40, 1], [1, 1, 1, 1, 1]),
    "mixed": ([0, 17, 31, 5, 16, 0], [1, 12, 1, 40, 1, 9]),
    "chunk-at-page-boundary": ([32, 16], [16, 7]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_reference(name: str) -> None:
    context_lens, query_lens = CASES[name]
    case = make_mixed_case(context_lens, query_lens)
    scale = 32**-0.5
    before = case.kv_cache.clone()
    backend = TorchAttentionBackend(case.kv_cache, 16, scale)
    backend.begin_step(case.batch)
    out = backend.forward(1, case.q, case.k, case.v, case.batch)

    assert out.shape == case.q.shape
    torch.testing.assert_close(out.double(), reference_attention(case, scale), atol=1e-5, rtol=1e-5)
    # New K/V landed at their slots of layer 1; other layers and unused pages are untouched.
    slots = case.batch.slot_mapping
    pages, offsets = slots // 16, slots % 16
    torch.testing.assert_close(case.kv_cache[1, pages, 0, :, offsets], case.k)
    torch.testing.assert_close(case.kv_cache[1, pages, 1, :, offsets], case.v)
    torch.testing.assert_close(case.kv_cache[0], before[0])
    unused = sorted(set(range(case.kv_cache.shape[1])) - case.used_pages)
    torch.testing.assert_close(case.kv_cache[1, unused], before[1, unused])


def test_bfloat16_cache() -> None:
    case = make_mixed_case([0, 20, 9], [5, 1, 1], dtype=torch.bfloat16)
    backend = TorchAttentionBackend(case.kv_cache, 16, 32**-0.5)
    out = backend.forward(1, case.q, case.k, case.v, case.batch)
    assert out.dtype == torch.bfloat16
    expected = reference_attention(case, 32**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_factory_names() -> None:
    cache = torch.zeros(1, 4, 2, 2, 16, 8)
    assert isinstance(create_attention_backend("torch", cache, 16, 1.0), TorchAttentionBackend)
    # auto on a CPU cache never picks FlashInfer.
    assert isinstance(create_attention_backend("auto", cache, 16, 1.0), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_attention_backend("flash", cache, 16, 1.0)
    with pytest.raises(RuntimeError, match="CUDA"):
        create_attention_backend("flashinfer", cache, 16, 1.0)
