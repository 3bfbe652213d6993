"""Prefix cache: refcounted full KV pages keyed by a hash chain; idle ones LRU-evictable.

A private page with several holders is freed by its last. Engine thread only."""

from __future__ import annotations

from collections import OrderedDict

from service.engine.kv_pool import KVPoolExhausted, PageAllocator


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.allocator, self.page_size, self.enabled = allocator, page_size, enabled
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # cached page -> requests holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached pages, oldest first
        self._extra: dict[int, int] = {}  # private page -> holders beyond its first

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

    def hold(self, pages: list[int]) -> None:
        """One more holder of pages someone already holds; release() gives back."""
        refs, extra = self._refs, self._extra
        for page in pages:
            if page in refs:
                refs[page] += 1
            else:
                extra[page] = extra.get(page, 0) + 1

    def alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0:
            if short > len(self._lru):
                raise KVPoolExhausted(f"need {n} KV pages, {self.available_pages} free or "
                                      "evictable")
            self._evict(short)
        return self.allocator.alloc(n)

    def _evict(self, n: int) -> None:
        lru, page_of, key_of, refs = self._lru, self._page_of, self._key_of, self._refs
        pages = [lru.popitem(last=False)[0] for _ in range(n)]
        for page in pages:
            del page_of[key_of.pop(page)], refs[page]
        self.allocator.free(pages)

    def insert(self, keys: list[bytes], pages: list[int], written_tokens: int) -> None:
        """Publish the request's full pages whose KV is written; it keeps holding them."""
        if not self.enabled:
            return
        page_of, key_of, refs = self._page_of, self._key_of, self._refs
        for key, page in zip(keys[:written_tokens // self.page_size], pages):
            # not if already published, or the same tokens are cached in another page
            if page not in key_of and key not in page_of:
                page_of[key], key_of[page] = page, key
                refs[page] = 1 + self._extra.pop(page, 0)

    def release(self, pages: list[int]) -> None:
        """A request lets go of its pages: cached ones may become evictable, private ones free."""
        private, key_of, refs, lru, extra = [], self._key_of, self._refs, self._lru, self._extra
        # NOTE: last page first into the LRU: evicting a first page would strand the later ones
        for page in reversed(pages):
            if page in key_of:
                refs[page] -= 1
                assert refs[page] >= 0, f"page {page} released more often than held"
                if refs[page] == 0:
                    lru[page] = None
            elif page in extra:
                extra[page] -= 1
                if extra[page] == 0:
                    del extra[page]
            else:
                private.append(page)
        self.allocator.free(private)

    def clear(self) -> None:
        self._evict(len(self._lru))
