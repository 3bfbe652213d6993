"""Prompt KV restaged into the pages vLLM's NIXL decode reads (LBHNC: [kv_heads][tokens][K|V])."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.host_copy import to_device
from service.engine.interface import KVPoolExhausted
from service.engine.kv_pool import PageAllocator
from service.engine.pages import pages_for
from service.model.config import ModelConfig


def export_pages(tokens: int, page_size: int) -> int:
    return pages_for(tokens, page_size) + 1  # page 0 is never handed out


def export_bytes(cfg: ModelConfig, tokens: int, page_size: int, dtype_bytes: int) -> int:
    return export_pages(tokens, page_size) * page_size * cfg.kv_bytes_per_token(dtype_bytes)


class OldestFirst(PageAllocator):
    """Hands out the pages freed longest ago: a decode that reads an expired offer late (as from
    vLLM's own prefill, nothing stops it) most likely still finds that offer's KV."""

    def free(self, pages: list[int]) -> None:
        super().free(pages)  # appended where alloc takes from: move them to the other end
        if pages:
            n = len(pages)
            self._free[:0] = self._free[-n:]
            del self._free[-n:]


class ExportRegion:
    """`data` (layers, pages, kv_heads, page_size, 2*head_dim): one NIXL region per layer; the
    pool's separate token-major K and V planes are not a layout the decode reads."""

    def __init__(self, cfg: ModelConfig, pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.page_size = page_size
        self.data = torch.zeros((cfg.num_layers, pages, cfg.num_kv_heads, page_size,
                                 2 * cfg.head_dim), dtype=dtype, device=device)
        self.allocator = OldestFirst(pages)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[1]

    @property
    def block_len(self) -> int:
        """Bytes of one page of one layer; pages are packed, so it is also the block stride."""
        return self.data[0, 0].numel() * self.data.element_size()

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.data.unbind(0))

    @property
    def base_addrs(self) -> list[int]:
        return [t.data_ptr() for t in self.layers]

    def stage(self, pool_data: torch.Tensor, page_ids: Sequence[int]) -> list[int]:
        """Queue copies of pool pages (all layers) into fresh export pages; sync before a read."""
        two, layers, slots, heads, head_dim = pool_data.shape
        ps = self.page_size
        assert two == 2 and slots % ps == 0, f"pool shape {tuple(pool_data.shape)}, page {ps}"
        d = self.data
        assert (layers, heads, 2 * head_dim, pool_data.dtype) == (
            d.shape[0], d.shape[2], d.shape[4], d.dtype), "pool and export region differ"
        try:
            ids = self.allocator.alloc(len(page_ids))
        except KVPoolExhausted as e:
            raise KVPoolExhausted(f"KV export region: {e}") from None
        if not ids:
            return ids
        dev = self.data.device
        src = to_device(torch.tensor(page_ids, dtype=torch.int64), dev)
        dst = to_device(torch.tensor(ids, dtype=torch.int64), dev)
        pages = pool_data.view(2, layers, slots // ps, -1)[:, :, src]  # (2, L, n, ps*H*D)
        pages = pages.view(2, layers, len(ids), ps, heads, head_dim)
        # (2, L, n, ps, H, D) -> (L, n, H, ps, 2, D): K then V in each token's last dim
        out = self.data.view(layers, self.num_blocks, heads, ps, 2, head_dim)
        out[:, dst] = pages.permute(1, 2, 4, 3, 0, 5)
        return ids

    def free(self, ids: list[int]) -> None:
        self.allocator.free(ids)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free
