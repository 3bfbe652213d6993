"""The export region against a PyTorch reference of the page vLLM 0.32's NIXL decode reads:
per layer, page = [kv_heads][page_size tokens][K | V] (LBHNC)."""

from __future__ import annotations

import pytest
import torch

from service.engine.interface import KVPoolExhausted
from service.kv_transfer.export import ExportRegion
from service.model.config import ModelConfig

PS = 4


def cfg(layers: int = 3, kv_heads: int = 3, head_dim: int = 6) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32, hidden_size=kv_heads * head_dim * 2,
                       intermediate_size=8, num_layers=layers, num_heads=kv_heads * 2,
                       num_kv_heads=kv_heads, head_dim=head_dim)


def random_pool(c: ModelConfig, pages: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, c.num_layers, pages * PS, c.num_kv_heads, c.head_dim).to(dtype)


def check_lbhnc(region: ExportRegion, pool: torch.Tensor, pages: list[int], ids: list[int],
                tokens: int) -> None:
    """Token t of the prompt sits in export page ids[t // PS], row t % PS, K then V per head."""
    d = pool.shape[-1]
    for t in range(tokens):
        i, o = divmod(t, PS)
        slot = pages[i] * PS + o
        got = region.data[:, ids[i], :, o]  # (L, H, 2D)
        assert torch.equal(got[..., :d], pool[0, :, slot]), f"K of token {t}"
        assert torch.equal(got[..., d:], pool[1, :, slot]), f"V of token {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_writes_the_decode_page_layout(dtype):
    c = cfg()
    pool = random_pool(c, 12, dtype)
    region = ExportRegion(c, 9, PS, dtype, "cpu")
    pages, tokens = [7, 2, 11, 5], 3 * PS + 3  # scattered pool pages, a partial last page
    ids = region.stage(pool, pages)
    assert len(ids) == 4 and 0 not in ids and len(set(ids)) == 4
    check_lbhnc(region, pool, pages, ids, tokens)
    assert not region.data[:, 0].any(), "page 0 is never written"


def test_staged_pages_stay_until_freed():
    c = cfg(layers=2, kv_heads=1, head_dim=4)
    pool = random_pool(c, 10)
    region = ExportRegion(c, 6, PS, torch.float32, "cpu")
    a = region.stage(pool, [3, 8])
    b = region.stage(pool, [1, 9, 4])
    assert region.num_free == 0
    with pytest.raises(KVPoolExhausted, match="export region"):
        region.stage(pool, [2])
    check_lbhnc(region, pool, [3, 8], a, 2 * PS)
    region.free(a)
    pool2 = random_pool(c, 10)
    c_ids = region.stage(pool2, [6, 5])
    assert sorted(c_ids) == sorted(a)
    check_lbhnc(region, pool, [1, 9, 4], b, 3 * PS)
    check_lbhnc(region, pool2, [6, 5], c_ids, 2 * PS)
    assert region.stage(pool, []) == []


def test_region_facts_address_each_page():
    c = cfg(layers=2, kv_heads=3, head_dim=6)
    region = ExportRegion(c, 5, PS, torch.float32, "cpu")
    region.stage(random_pool(c, 6), [4, 1, 3])
    assert region.num_blocks == 5
    assert region.block_len == 3 * PS * 2 * 6 * 4
    flat, base0 = region.data.view(-1), region.data.data_ptr()
    for layer, base in enumerate(region.base_addrs):
        assert base == region.data[layer].data_ptr()
        for e in range(region.num_blocks):  # vLLM reads base + e * block_stride, block_len bytes
            start = (base + e * region.block_len - base0) // 4
            page = flat[start:start + region.block_len // 4]
            assert torch.equal(page, region.data[layer, e].reshape(-1))


def test_freed_export_pages_are_reused_last():
    """An expired offer's pages wait behind every other free page before they are staged over."""
    from service.kv_transfer.export import OldestFirst

    alloc = OldestFirst(9)
    a, b = alloc.alloc(3), alloc.alloc(3)
    alloc.free(a)
    assert set(alloc.alloc(2)).isdisjoint(a)  # the 2 never-used pages come first
    assert sorted(alloc.alloc(3)) == sorted(a)  # then the oldest freed
    alloc.free(b)
    with pytest.raises(AssertionError):
        alloc.free(b)  # double frees are still caught
