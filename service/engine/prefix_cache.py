"""Page-granular prefix cache: full KV pages keyed by a hash chain of their token ids.

Pages are refcounted; cached ones at refcount 0 stay, evictable in LRU order; engine thread only."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from service.engine.kv_pool import KVPoolExhausted, PageAllocator


def page_keys(token_ids, page_size: int) -> list[bytes]:
    """Chain keys of every full page of `token_ids` (ints or an int64 array: the same keys)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    data = memoryview(ids).cast("B")
    step = page_size * ids.itemsize
    keys, parent = [], b""
    for start in range(0, (len(ids) // page_size) * step, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.allocator, self.page_size, self.enabled = allocator, page_size, enabled
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # cached page -> key
        self._refs: dict[int, int] = {}  # cached page -> requests holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached pages, oldest first

    @property
    def available_pages(self) -> int:
        """Pages admission may use: free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self._lru)

    @property
    def used_pages(self) -> int:
        return self.allocator.capacity - self.allocator.num_free - len(self._lru)

    @property
    def cached_pages(self) -> int:
        return len(self._key_of)

    def match(self, keys: list[bytes], max_pages: int) -> list[int]:
        """Acquire the longest cached prefix (at most `max_pages` pages); release() gives back."""
        if not self.enabled:
            return []
        pages = []
        for key in keys[:max_pages]:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._refs[page] += 1
            self._lru.pop(page, None)
        return pages

    def alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > len(self._lru):
            raise KVPoolExhausted(f"need {n} KV pages, {self.available_pages} free or evictable")
        for _ in range(max(short, 0)):
            self._evict_oldest()
        return self.allocator.alloc(n)

    def _evict_oldest(self) -> None:
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)], self._refs[page]
        self.allocator.free([page])

    def insert(self, keys: list[bytes], pages: list[int], written_tokens: int) -> None:
        """Publish the request's full pages whose KV is written; it keeps holding them."""
        if not self.enabled:
            return
        for key, page in zip(keys[:written_tokens // self.page_size], pages):
            if page in self._key_of or key in self._page_of:
                continue  # already published, or the same tokens cached in another page
            self._page_of[key], self._key_of[page], self._refs[page] = page, key, 1

    def release(self, pages: list[int]) -> None:
        """A request lets go of its pages: cached ones may become evictable, private ones free."""
        private = []
        # NOTE: last page first into the LRU: evicting a first page would strand the later ones
        for page in reversed(pages):
            if page in self._key_of:
                self._refs[page] -= 1
                assert self._refs[page] >= 0, f"page {page} released more often than held"
                if self._refs[page] == 0:
                    self._lru[page] = None
            else:
                private.append(page)
        self.allocator.free(private)

    def clear(self) -> None:
        while self._lru:
            self._evict_oldest()
