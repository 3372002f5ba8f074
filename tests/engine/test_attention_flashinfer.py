"""FlashInfer backend on CUDA: same results as the dense reference (skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.attention_cases import make_mixed_case, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [([0, 0], [23, 16]), ([0, 15, 16, 40], [1, 1, 1, 1]), ([0, 17, 31, 5, 16], [1, 12, 1, 40, 1])],
)
def test_flashinfer_matches_reference(context_lens: list[int], query_lens: list[int]) -> None:
    from workers.engine.attention import create_attention_backend

    head_dim = 128  # FlashInfer's prebuilt kernels cover the common head sizes
    case = make_mixed_case(
        context_lens, query_lens, head_dim=head_dim, dtype=torch.bfloat16, device="cuda"
    )
    scale = head_dim**-0.5
    backend = create_attention_backend("auto", case.kv_cache, 16, scale, num_qo_heads=8)
    assert backend.name == "flashinfer"
    backend.begin_step(case.batch)
    out = backend.forward(1, case.q, case.k, case.v, case.batch)
    expected = reference_attention(case, scale)
    torch.testing.assert_close(out.double().cpu(), expected, atol=3e-2, rtol=3e-2)
