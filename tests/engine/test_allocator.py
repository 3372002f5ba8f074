"""Page allocator and KV pool helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.engine.block_manager import BlockManager, PageAllocationError
from workers.engine.errors import CapacityError
from workers.engine.kv_cache import (
    allocate_kv_cache,
    copy_pages,
    num_pages_for_budget,
    page_layer_bytes,
    page_nbytes,
    read_pages,
)
from workers.engine.model_config import MLAConfig, ModelConfig


def _model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )


def test_allocate_and_free_return_pages() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    pages = bm.allocate(3)
    assert len(set(pages)) == 3 and bm.num_free_pages == 5
    bm.check_invariants()
    bm.free(pages)
    assert bm.num_free_pages == 8
    bm.check_invariants()


def test_free_twice_is_an_error() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    pages = bm.allocate(2)
    bm.free(pages)
    with pytest.raises(PageAllocationError, match="freed twice"):
        bm.free(pages[:1])
    bm.check_invariants()


def test_ref_counts_keep_shared_pages() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    pages = bm.allocate(1)
    bm.incref(pages)
    bm.free(pages)
    assert bm.num_free_pages == 3 and bm.ref_count(pages[0]) == 1
    bm.free(pages)
    assert bm.num_free_pages == 4


def test_allocation_beyond_the_pool_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    bm.allocate(3)
    with pytest.raises(CapacityError):
        bm.allocate(2)
    assert bm.num_free_pages == 1
    bm.check_invariants()


def test_pinned_pages_cannot_be_freed_until_unpinned() -> None:
    bm = BlockManager(num_pages=6, page_size=4)
    pinned = bm.allocate_pinned(2)
    assert bm.num_pinned_pages == 2 and all(bm.is_pinned(p) for p in pinned)
    with pytest.raises(PageAllocationError, match="pinned"):
        bm.free(pinned)
    bm.check_invariants()
    bm.unpin(pinned[:1])
    bm.free(pinned[:1])
    bm.free_pinned(pinned[1:])
    assert bm.num_free_pages == 6 and bm.num_pinned_pages == 0
    with pytest.raises(PageAllocationError, match="not pinned"):
        bm.unpin(pinned[:1])


def test_refused_page_transitions_change_nothing() -> None:
    manager = BlockManager(8, 4)
    (pinned,) = manager.allocate_pinned(1)
    (allocated,) = manager.allocate(1)

    def unchanged() -> None:
        manager.check_invariants()
        assert manager.is_pinned(pinned) and manager.ref_count(pinned) == 1
        assert not manager.is_pinned(allocated) and manager.ref_count(allocated) == 1
        assert manager.num_free_pages == 6

    with pytest.raises(PageAllocationError, match="not pinned"):
        manager.free_pinned([pinned, allocated])
    unchanged()
    with pytest.raises(PageAllocationError, match="not pinned"):
        manager.unpin([pinned, allocated])
    unchanged()
    with pytest.raises(PageAllocationError, match="repeat"):
        manager.free_pinned([pinned, pinned])
    unchanged()
    with pytest.raises(PageAllocationError, match="pinned"):
        manager.free([allocated, pinned])
    unchanged()
    with pytest.raises(PageAllocationError, match="freed twice"):
        manager.free([allocated, allocated])
    unchanged()
    manager.free_pinned([pinned])
    manager.free([allocated])
    manager.check_invariants()
    assert manager.num_free_pages == 8


def test_check_invariants_detects_a_leak() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    page = bm.allocate(1)[0]
    bm._ref_counts[page] = 0  # simulate a lost reference
    with pytest.raises(AssertionError, match="leak"):
        bm.check_invariants()


def test_pool_size_from_memory_budget() -> None:
    config = _model_config()
    per_page = page_nbytes(config, page_size=4, dtype=torch.float32)
    assert per_page == 3 * 2 * 2 * 4 * 4 * 4
    assert num_pages_for_budget(config, 4, torch.float32, per_page * 10 + 5) == 10
    with pytest.raises(ValueError):
        num_pages_for_budget(config, 4, torch.float32, per_page - 1)


def test_copy_pages_between_pools_with_different_ids() -> None:
    config = _model_config()
    src = allocate_kv_cache(config, num_pages=6, page_size=4, dtype=torch.float32)
    dst = allocate_kv_cache(config, num_pages=5, page_size=4, dtype=torch.float32)
    assert src.shape == (3, 6, 2, 2, 4, 4)
    src.copy_(torch.randn_like(src))
    copy_pages(src, [1, 4], dst, [3, 0])
    assert torch.equal(dst[:, 3], src[:, 1]) and torch.equal(dst[:, 0], src[:, 4])
    assert torch.count_nonzero(dst[:, [1, 2, 4]]) == 0
    assert torch.equal(read_pages(dst, [3]), src[:, [1]])
    raw = page_layer_bytes(src, layer=2, page_id=4)
    assert len(raw) == 2 * 2 * 4 * 4 * 4
    assert raw == src[2, 4].numpy().tobytes()


def test_mla_pool_has_one_latent_plane() -> None:
    """Under MLA a page holds one latent row per token (no V): half a dense page's planes."""
    mla = MLAConfig(
        kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, q_lora_rank=None
    )
    config = dataclasses.replace(
        _model_config(), architecture="DeepseekV2ForCausalLM", num_kv_heads=1, head_dim=12, mla=mla
    )
    assert config.kv_planes == 1
    per_page = page_nbytes(config, page_size=4, dtype=torch.float32)
    assert per_page == 3 * 1 * 1 * 4 * 12 * 4
    src = allocate_kv_cache(config, num_pages=6, page_size=4, dtype=torch.float32)
    dst = allocate_kv_cache(config, num_pages=5, page_size=4, dtype=torch.float32)
    assert src.shape == (3, 6, 1, 1, 4, 12)
    assert src.numel() * src.element_size() == 6 * per_page
    src.copy_(torch.randn_like(src))
    copy_pages(src, [1, 4], dst, [3, 0])
    assert torch.equal(dst[:, 3], src[:, 1]) and torch.equal(dst[:, 0], src[:, 4])
    assert torch.equal(read_pages(dst, [0, 3]), src[:, [4, 1]])
    raw = page_layer_bytes(src, layer=1, page_id=4)
    assert len(raw) == per_page // 3
    assert raw == src[1, 4].numpy().tobytes()
