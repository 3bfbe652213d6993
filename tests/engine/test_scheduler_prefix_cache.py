"""Prefix cache in the scheduler: reuse of full pages, eviction under pressure, refcounts."""

from __future__ import annotations

import asyncio

from service.engine.pages import page_keys
from service.engine.prefix_cache import PrefixCache
from tests.engine.test_scheduler import FakeEngine, req, run, started


def test_page_keys_chain() -> None:
    a = page_keys(tuple(range(10)), 4)
    assert len(a) == 2  # full pages only
    assert page_keys(tuple(range(8)), 4) == a
    b = page_keys((99, *range(1, 10)), 4)
    assert a[0] != b[0] and a[1] != b[1]  # a different first page changes every later key


def test_second_prompt_reuses_full_pages() -> None:
    async def main():
        eng = FakeEngine(pages=16, page_size=4, budget=64)
        s = await started(eng)
        ids = list(range(1, 13))  # 12 tokens = 3 full pages
        first = req(ids)
        s.submit([first])
        r1 = await first.future
        again = req(ids + [40, 41])  # 14 tokens: 3 full pages cached
        s.submit([again])
        r2 = await again.future
        assert (r1.cached_tokens, r2.cached_tokens) == (0, 12)
        chunk = eng.calls[-1][0]
        assert (chunk.prefix_len, chunk.token_ids) == (12, (40, 41))
        assert chunk.pages[:3] == eng.calls[0][0].pages[:3]
        same = req(ids)  # identical prompt: the last token is always recomputed
        s.submit([same])
        assert (await same.future).cached_tokens == 8
        scored = req(ids, prompt_logprobs=True)  # needs every position's logits: no reuse
        s.submit([scored])
        res = await scored.future
        assert res.cached_tokens == 0 and len(res.prompt_logprobs) == 11
        assert s.kv_used_tokens == 0 and s.kv_cached_tokens == 12
        s.stop()
        assert eng.pool.used_tokens == 0  # idle cached pages go back at shutdown

    run(main())


def test_evictable_pages_count_as_free() -> None:
    async def main():
        eng = FakeEngine(pages=4, page_size=4, budget=64)
        s = await started(eng)
        for base in (100, 200):  # each fills the pool with 4 cached pages
            r = req([base + i for i in range(16)])
            s.submit([r])
            await r.future
        assert s.kv_cached_tokens == 16 and s.kv_used_tokens == 0
        r = req([100 + i for i in range(16)])  # its pages were evicted by the 200-series prompt
        s.submit([r])
        assert (await r.future).cached_tokens == 0
        s.stop()

    run(main())


def test_concurrent_identical_prompts_share_safely() -> None:
    async def main():
        eng = FakeEngine(pages=16, page_size=4, budget=64)
        s = await started(eng)
        ids = list(range(1, 18))
        rs = [req(ids) for _ in range(3)]
        s.submit(rs)  # one forward: nothing is published before it, so no reuse yet
        out = await asyncio.gather(*(r.future for r in rs))
        assert {o.next.token.id for o in out} == {18}
        assert s.kv_used_tokens == 0 and s.kv_cached_tokens == 16
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())


def test_release_and_refcounts() -> None:
    from service.engine.kv_pool import PageAllocator

    alloc = PageAllocator(5)
    cache = PrefixCache(alloc, 2)
    keys = page_keys((1, 2, 3, 4), 2)
    pages = cache.alloc(2)
    cache.insert(keys, pages, 4)
    held = cache.match(keys, 2)
    assert held == pages and cache.used_pages == 2
    cache.release(pages)
    assert cache.used_pages == 2  # still held by the second holder
    cache.release(held)
    assert cache.used_pages == 0 and cache.available_pages == 4
    assert len(cache.alloc(4)) == 4 and cache.cached_pages == 0  # evicted to make room


def test_eviction_keeps_a_prompts_leading_pages() -> None:
    # Keys chain from the page before, so a prompt's pages must be evicted last-page-first:
    # losing page 0 first would strand the later pages (cached, but never matchable).
    from service.engine.kv_pool import PageAllocator

    alloc = PageAllocator(5)  # 4 usable pages
    cache = PrefixCache(alloc, 2)
    keys = page_keys((1, 2, 3, 4, 5, 6, 7, 8), 2)
    pages = cache.alloc(4)
    cache.insert(keys, pages, 8)
    cache.release(pages)
    assert cache.cached_pages == 4 and alloc.num_free == 0
    fresh = cache.alloc(1)  # evicts exactly one cached page
    assert cache.cached_pages == 3
    assert cache.match(keys, 4) == pages[:3]  # the three leading pages still match
    cache.release(pages[:3])
    alloc.free(fresh)
