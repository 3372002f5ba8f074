"""The torch attention backend against dense attention (K|V caches and MLA's single-plane
latent cache), plus the backend factory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.attention_cases import MixedCase, make_mixed_case, reference_attention
from workers.engine.attention import cpu_kernel, create_attention_backend
from workers.engine.attention.torch_backend import TorchAttentionBackend

# The three ways to attend decode tokens: the C++ kernel (default on CPU), the sparse sampled
# matmul (float32 without the kernel), gathering pages for SDPA (everything else). Chunk tokens
# go to the C++ prefill kernel with the first (the CPU default), to SDPA with the others.
DECODE_PATHS = {
    "kernel": {"decode_kernel": True, "prefill_kernel": True},
    "sparse": {"decode_kernel": False, "sparse_decode": True, "prefill_kernel": False},
    "gather": {"decode_kernel": False, "sparse_decode": False, "prefill_kernel": False},
}

CASES = {
    # (cached context lengths, new token counts) per sequence
    "prefill-only": ([0, 0], [23, 16]),
    "decode-only": ([0, 15, 16, 40, 1], [1, 1, 1, 1, 1]),
    "mixed": ([0, 17, 31, 5, 16, 0], [1, 12, 1, 40, 1, 9]),
    "chunk-at-page-boundary": ([32, 16], [16, 7]),
}


@pytest.mark.parametrize("path", list(DECODE_PATHS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_reference(name: str, path: str) -> None:
    context_lens, query_lens = CASES[name]
    case = make_mixed_case(context_lens, query_lens)
    scale = 32**-0.5
    before = case.kv_cache.clone()
    backend = TorchAttentionBackend(case.kv_cache, 16, scale, **DECODE_PATHS[path])
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


# Decode sequences of very different lengths, in an order that is not sorted by length: several
# groups, masks inside groups whose lengths differ, and rows reordered for grouping and back.
LONG_CASES = {
    "decode-spread": ([300, 4, 140, 15, 299, 63, 150, 0, 16], [1] * 9),
    "decode-spread-with-chunks": ([300, 4, 0, 140, 31, 299], [1, 1, 20, 1, 9, 1]),
    "decode-equal-lengths": ([200, 200, 200], [1, 1, 1]),
    # Lengths close enough for the sparse path to pad rows to the longest (a masked softmax).
    "decode-near-lengths": ([290, 256, 300, 271, 299], [1] * 5),
    "decode-near-lengths-with-chunks": ([290, 0, 256, 300, 40], [1, 30, 1, 1, 8]),
}


@pytest.mark.parametrize("name", list(LONG_CASES))
@pytest.mark.parametrize("group_bytes", ["kernel", "sparse", 1, 64 << 10, 1 << 30])
def test_long_and_mixed_decode_matches_dense_reference(name: str, group_bytes: int | str) -> None:
    """``group_bytes`` "kernel" / "sparse": those paths (no gather); otherwise the gather path,
    where 1 puts every decode sequence in its own group, 64 KiB (8 of this case's 8 KiB pages)
    splits the longest buckets, 1 GiB never splits."""
    context_lens, query_lens = LONG_CASES[name]
    case = make_mixed_case(context_lens, query_lens, num_pages=160)
    scale = 32**-0.5
    if isinstance(group_bytes, str):
        backend = TorchAttentionBackend(case.kv_cache, 16, scale, **DECODE_PATHS[group_bytes])
    else:
        backend = TorchAttentionBackend(
            case.kv_cache, 16, scale, gather_group_bytes=group_bytes, **DECODE_PATHS["gather"]
        )
    backend.begin_step(case.batch)
    out = backend.forward(1, case.q, case.k, case.v, case.batch)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_state_reused_across_layers_and_steps(path: str) -> None:
    """The gather buffer, the sparse structure and the kernel's page rows are reused by later
    layers and steps: a small step after a large one, and layer 0 after layer 1, still read
    their own pages."""
    scale = 32**-0.5
    large = make_mixed_case([300, 120, 7], [1, 1, 1], num_pages=160, layer=1, seed=1)
    backend = TorchAttentionBackend(large.kv_cache, 16, scale, **DECODE_PATHS[path])
    out_large = backend.forward(1, large.q, large.k, large.v, large.batch)
    small = make_mixed_case([40, 3], [1, 1], num_pages=160, layer=0, seed=2)
    # Same cache tensor for both steps: copy the small case's layer 0 into the large cache.
    large.kv_cache[0].copy_(small.kv_cache[0])
    out_small = backend.forward(0, small.q, small.k, small.v, small.batch)
    torch.testing.assert_close(
        out_large.double(), reference_attention(large, scale), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        out_small.double(), reference_attention(small, scale), atol=1e-5, rtol=1e-5
    )


def test_non_contiguous_cache_stores_through_indexing() -> None:
    """A cache that is a strided view (no flat row view) takes the indexed store."""
    case = make_mixed_case([0, 17, 40], [5, 1, 1], num_layers=4)
    strided = case.kv_cache[::2]  # layers 0 and 2 of 4
    assert not strided.is_contiguous()
    strided[0].copy_(case.kv_cache[1])  # put the case's layer-1 context into strided layer 0
    scale = 32**-0.5
    backend = TorchAttentionBackend(strided, 16, scale)
    out = backend.forward(0, case.q, case.k, case.v, case.batch)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), atol=1e-5, rtol=1e-5)
    pages, offsets = case.batch.slot_mapping // 16, case.batch.slot_mapping % 16
    torch.testing.assert_close(strided[0, pages, 0, :, offsets], case.k)
    torch.testing.assert_close(strided[0, pages, 1, :, offsets], case.v)


def test_decode_path_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is the default for a contiguous float32 or bfloat16 CPU cache on a CPU where it
    is preferred (AVX-512; `make install` builds it); without it the sparse path is, for float32
    only."""
    monkeypatch.setattr(cpu_kernel, "preferred", lambda: True)
    cache = torch.zeros(2, 4, 2, 2, 16, 8)
    assert cpu_kernel.paged_decode_attention() is not None, cpu_kernel.unavailable_reason()
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchAttentionBackend(cache.to(dtype), 16, 1.0)
        assert backend.decode_kernel and not backend.sparse_decode
    assert not TorchAttentionBackend(cache.to(torch.float16), 16, 1.0).decode_kernel
    assert TorchAttentionBackend(cache, 16, 1.0, decode_kernel=False).sparse_decode
    bf16 = TorchAttentionBackend(cache.to(torch.bfloat16), 16, 1.0, decode_kernel=False)
    assert not bf16.sparse_decode
    strided = torch.zeros(4, 4, 2, 2, 16, 8)[::2]
    backend = TorchAttentionBackend(strided, 16, 1.0, sparse_decode=True)
    assert not backend.decode_kernel and not backend.sparse_decode
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 CPU cache"):
        TorchAttentionBackend(strided, 16, 1.0, decode_kernel=True)
    # Switched off for A/B runs: the backend falls back, and asking for it names the reason.
    monkeypatch.setattr(cpu_kernel, "_loaded", None)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    assert TorchAttentionBackend(cache, 16, 1.0).sparse_decode
    with pytest.raises(ValueError, match="PDSERVE_CPU_ATTENTION_KERNEL=0"):
        TorchAttentionBackend(cache, 16, 1.0, decode_kernel=True)
    monkeypatch.setattr(cpu_kernel, "_loaded", None)


def test_prefill_path_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill kernel is the default for a contiguous float32 or bfloat16 CPU cache whose
    head size is a multiple of 16, on a CPU where it is preferred; chunks go to SDPA otherwise."""
    monkeypatch.setattr(cpu_kernel, "preferred", lambda: True)
    monkeypatch.setattr(cpu_kernel, "amx", lambda: False)
    cache = torch.zeros(2, 4, 2, 2, 16, 16)
    for dtype in (torch.float32, torch.bfloat16):
        assert TorchAttentionBackend(cache.to(dtype), 16, 1.0).prefill_kernel
    assert not TorchAttentionBackend(cache.half(), 16, 1.0).prefill_kernel
    assert not TorchAttentionBackend(cache, 16, 1.0, prefill_kernel=False).prefill_kernel
    narrow = torch.zeros(2, 4, 2, 2, 16, 8)
    assert not TorchAttentionBackend(narrow, 16, 1.0).prefill_kernel
    with pytest.raises(ValueError, match="multiple of 16"):
        TorchAttentionBackend(narrow, 16, 1.0, prefill_kernel=True)
    monkeypatch.setattr(cpu_kernel, "_loaded", None)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    assert not TorchAttentionBackend(cache, 16, 1.0).prefill_kernel
    with pytest.raises(ValueError, match="PDSERVE_CPU_ATTENTION_KERNEL=0"):
        TorchAttentionBackend(cache, 16, 1.0, prefill_kernel=True)
    monkeypatch.setattr(cpu_kernel, "_loaded", None)


def test_half_precision_chunks_go_to_sdpa_on_a_cpu_with_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With AMX tiles, torch's flash attention computes bfloat16 chunks on them (2-4x the
    kernel's speed, measured): a bfloat16 cache attends chunks with SDPA unless the kernel is
    asked for; float32 chunks and every decode token keep the kernels."""
    monkeypatch.setattr(cpu_kernel, "preferred", lambda: True)
    monkeypatch.setattr(cpu_kernel, "amx", lambda: True)
    cache = torch.zeros(2, 4, 2, 2, 16, 16)
    half = TorchAttentionBackend(cache.bfloat16(), 16, 1.0)
    assert not half.prefill_kernel and half.decode_kernel
    assert TorchAttentionBackend(cache, 16, 1.0).prefill_kernel
    assert TorchAttentionBackend(cache.bfloat16(), 16, 1.0, prefill_kernel=True).prefill_kernel


def test_kernels_are_not_the_default_where_not_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AVX-512 the torch paths attend unless a kernel is asked for."""
    monkeypatch.setattr(cpu_kernel, "preferred", lambda: False)
    cache = torch.zeros(2, 4, 2, 2, 16, 16)
    backend = TorchAttentionBackend(cache, 16, 1.0)
    assert not backend.decode_kernel and not backend.prefill_kernel and backend.sparse_decode
    asked = TorchAttentionBackend(cache, 16, 1.0, decode_kernel=True, prefill_kernel=True)
    assert asked.decode_kernel and asked.prefill_kernel


def test_preferred_follows_the_cpu() -> None:
    expected = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert cpu_kernel.preferred() is expected
    assert cpu_kernel.prefill_preferred(torch.float32) is expected
    assert cpu_kernel.prefill_preferred(torch.bfloat16) is (expected and not cpu_kernel.amx())


def test_kernels_take_queries_of_another_dtype_than_the_cache() -> None:
    """float32 activations over a bfloat16 cache: the kernels attend in the cache's dtype and the
    output comes back in the queries' (decode rows and chunk rows of one step)."""
    case = make_mixed_case([0, 20, 9, 40], [5, 1, 3, 1], dtype=torch.bfloat16)
    backend = TorchAttentionBackend(case.kv_cache, 16, 32**-0.5, **DECODE_PATHS["kernel"])
    out = backend.forward(1, case.q.float(), case.k.float(), case.v.float(), case.batch)
    assert out.dtype == torch.float32
    expected = reference_attention(case, 32**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_bfloat16_cache(path: str) -> None:
    case = make_mixed_case([0, 20, 9, 40], [5, 1, 1, 1], dtype=torch.bfloat16)
    backend = TorchAttentionBackend(case.kv_cache, 16, 32**-0.5, **DECODE_PATHS[path])
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


@pytest.mark.parametrize(
    ("context_lens", "softmax"),
    [([200, 200, 200], "dense"), ([290, 256, 300], "padded"), ([300, 4, 140], "segmented")],
)
def test_sparse_softmax_shape_follows_the_length_spread(
    context_lens: list[int], softmax: str
) -> None:
    """Equal lengths: one dense softmax; close ones: rows padded to the longest and masked;
    far apart: a segmented softmax (padding would multiply the work)."""
    case = make_mixed_case(context_lens, [1] * len(context_lens), num_pages=160)
    scale = 32**-0.5
    backend = TorchAttentionBackend(case.kv_cache, 16, scale, **DECODE_PATHS["sparse"])
    backend.begin_step(case.batch)
    out = backend.forward(1, case.q, case.k, case.v, case.batch)
    torch.testing.assert_close(out.double(), reference_attention(case, scale), atol=1e-5, rtol=1e-5)
    sparse = backend._sparse
    assert sparse is not None
    shape = "segmented" if sparse.width is None else "dense" if sparse.padding is None else "padded"
    assert shape == softmax


# --- latent mode: a single-plane cache (MLA), whose rows are the keys and the values -----------

LATENT_HEADS, LATENT_DIM = 8, 48  # one latent "KV head" of width kv_lora_rank + qk_rope_head_dim
LATENT_SCALE = 24**-0.5  # MLA's scale is that of the up-projected head, not of the latent width
LATENT_CASES = {
    # (cached context lengths, new token counts) per sequence
    "decode-equal-lengths": ([200, 200, 200], [1, 1, 1]),
    "decode-near-lengths": ([290, 256, 300, 271, 299], [1] * 5),
    "decode-far-lengths": ([300, 4, 140, 15, 0], [1] * 5),
    "prefill-only": ([0, 0], [23, 16]),
    "chunk-with-context": ([32, 16], [16, 7]),
    "mixed": ([0, 17, 31, 5, 16, 0, 290], [1, 12, 1, 40, 1, 9, 1]),
}


def latent_case(context_lens: list[int], query_lens: list[int], num_layers: int = 2) -> MixedCase:
    return make_mixed_case(
        context_lens,
        query_lens,
        num_heads=LATENT_HEADS,
        num_kv_heads=1,
        head_dim=LATENT_DIM,
        num_pages=160,
        num_layers=num_layers,
        latent=True,
    )


def latent_reference(case: MixedCase, scale: float) -> torch.Tensor:
    """Causal MQA per sequence with the values being the keys: SDPA with ``value=key``."""
    outputs = []
    for i, (start, n) in enumerate(
        zip(case.batch.query_start_loc.tolist(), case.batch.query_lens_list, strict=False)
    ):
        keys = case.full_k[i].transpose(0, 1)[None]  # [1, 1, L, D]
        total = keys.shape[2]
        mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
        query = case.q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        out = F.scaled_dot_product_attention(
            query, keys, keys, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("path", list(DECODE_PATHS))
@pytest.mark.parametrize("name", list(LATENT_CASES))
def test_latent_mode_matches_mqa_with_values_equal_to_keys(name: str, path: str) -> None:
    context_lens, query_lens = LATENT_CASES[name]
    case = latent_case(context_lens, query_lens)
    assert case.kv_cache.shape[2] == 1
    before = case.kv_cache.clone()
    backend = TorchAttentionBackend(
        case.kv_cache, 16, LATENT_SCALE, gather_group_bytes=64 << 10, **DECODE_PATHS[path]
    )
    assert backend.latent
    assert (backend.decode_kernel, backend.sparse_decode) == (path == "kernel", path == "sparse")
    backend.begin_step(case.batch)
    out = backend.forward(1, case.q, case.k, None, case.batch)

    assert out.shape == case.q.shape == (sum(query_lens), LATENT_HEADS, LATENT_DIM)
    torch.testing.assert_close(out, latent_reference(case, LATENT_SCALE), atol=1e-5, rtol=1e-5)
    # The new latents landed as is at their slots of layer 1 (the one plane); nothing else moved.
    slots = case.batch.slot_mapping
    pages, offsets = slots // 16, slots % 16
    assert torch.equal(case.kv_cache[1, pages, 0, :, offsets], case.k)
    written = torch.zeros(case.kv_cache.shape[1:], dtype=torch.bool)
    written[pages, 0, :, offsets] = True
    assert torch.equal(case.kv_cache[1][~written], before[1][~written])
    assert torch.equal(case.kv_cache[0], before[0])


@pytest.mark.parametrize(
    ("context_lens", "softmax"),
    [([200, 200, 200], "dense"), ([290, 256, 300], "padded"), ([300, 4, 140], "segmented")],
)
def test_latent_sparse_decode_reads_values_from_the_key_rows(
    context_lens: list[int], softmax: str
) -> None:
    """Every softmax shape of the sparse path, with the value rows being the key rows."""
    case = latent_case(context_lens, [1] * len(context_lens))
    backend = TorchAttentionBackend(case.kv_cache, 16, LATENT_SCALE, **DECODE_PATHS["sparse"])
    out = backend.forward(1, case.q, case.k, None, case.batch)
    torch.testing.assert_close(out, latent_reference(case, LATENT_SCALE), atol=1e-5, rtol=1e-5)
    sparse = backend._sparse
    assert sparse is not None
    shape = "segmented" if sparse.width is None else "dense" if sparse.padding is None else "padded"
    assert shape == softmax
    assert torch.equal(sparse.value_rows, sparse.pattern.col_indices())


def test_latent_mode_non_contiguous_cache_stores_through_indexing() -> None:
    case = latent_case([0, 17, 40], [5, 1, 1], num_layers=4)
    strided = case.kv_cache[::2]
    assert not strided.is_contiguous()
    strided[0].copy_(case.kv_cache[1])
    backend = TorchAttentionBackend(strided, 16, LATENT_SCALE)
    out = backend.forward(0, case.q, case.k, None, case.batch)
    torch.testing.assert_close(out, latent_reference(case, LATENT_SCALE), atol=1e-5, rtol=1e-5)
    pages, offsets = case.batch.slot_mapping // 16, case.batch.slot_mapping % 16
    assert torch.equal(strided[0, pages, 0, :, offsets], case.k)


def test_v_must_match_the_cache_planes() -> None:
    dense = make_mixed_case([0, 4], [3, 1])
    backend = TorchAttentionBackend(dense.kv_cache, 16, 32**-0.5)
    with pytest.raises(ValueError, match=r"two-plane \(K\|V\) KV cache needs v"):
        backend.forward(1, dense.q, dense.k, None, dense.batch)
    latent = latent_case([0, 4], [3, 1])
    backend = TorchAttentionBackend(latent.kv_cache, 16, LATENT_SCALE)
    with pytest.raises(ValueError, match="takes no v"):
        backend.forward(1, latent.q, latent.k, latent.k, latent.batch)
    with pytest.raises(ValueError, match="1 or 2 planes"):
        TorchAttentionBackend(torch.zeros(1, 4, 3, 1, 16, 8), 16, 1.0)


def test_factory_keeps_latent_caches_on_torch() -> None:
    cache = torch.zeros(1, 4, 1, 1, 16, 8)
    assert isinstance(create_attention_backend("auto", cache, 16, 1.0), TorchAttentionBackend)
    # Refused before any device check: the paged FlashInfer wrapper reads K and V planes.
    with pytest.raises(NotImplementedError, match="MLA latent caches run on the torch backend"):
        create_attention_backend("flashinfer", cache, 16, 1.0)
