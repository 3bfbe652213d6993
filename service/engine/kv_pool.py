"""The KV pool (per-layer tensors) and its page allocator (alloc/free only), kept apart."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.host_copy import to_device
from service.engine.interface import KVPoolExhausted
from service.engine.pages import pages_for
from service.model.config import ModelConfig
from service.model.meta import KVCache


class PageAllocator:
    """Hands out page ids 1..num_pages-1; page 0 is the dummy page and is never handed out."""

    def __init__(self, num_pages: int):
        assert num_pages >= 2, f"a KV pool needs at least 2 pages (1 dummy), got {num_pages}"
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolExhausted(f"need {n} KV pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[:-n - 1:-1]
        del self._free[-n:]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        held = len(self._used)
        self._used.difference_update(pages)
        if len(self._used) != held - len(pages):
            bad = next(p for i, p in enumerate(pages) if p in pages[:i] or p not in self._used)
            raise AssertionError(f"page {bad} freed twice or never allocated")
        self._free.extend(pages)


class KVPool:
    def __init__(self, cfg: ModelConfig, num_tokens: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        num_pages = pages_for(num_tokens, page_size) + 1
        slots = num_pages * page_size
        # one allocation, so a page copies across every layer in one launch (copy_pages)
        self.data = torch.zeros((2, cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim),
                                dtype=dtype, device=device)
        self.cache = KVCache(k=list(self.data[0].unbind(0)), v=list(self.data[1].unbind(0)),
                             page_size=page_size)
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """KV of page src[i] -> page dst[i] in every layer, on the current stream."""
        ps = self.page_size
        offs = torch.arange(ps, dtype=torch.int64)
        s, d = (to_device((torch.tensor(p, dtype=torch.int64)[:, None] * ps + offs).ravel(),
                          self.data.device) for p in (src, dst))
        self.data.index_copy_(2, d, self.data.index_select(2, s))

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    @property
    def used_tokens(self) -> int:
        return (self.allocator.capacity - self.allocator.num_free) * self.page_size

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes
