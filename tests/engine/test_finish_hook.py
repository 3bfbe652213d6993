"""The prompt-finish hook through the real scheduler and EngineCore on CPU: page leases (held,
shared with the prefix cache, released from another thread, expired, dropped at shutdown) and
the final hidden row of a prompt's last token."""

from __future__ import annotations

import threading

import torch

from service.engine.batch import SeqChunk
from service.engine.core import EngineCore
from service.engine.finish import FinishHook, Lease
from service.engine.scheduler import Scheduler
from tests.engine.helpers import PAGE, engine_cfg, prompts, tiny_loaded
from tests.engine.test_scheduler import FakeEngine, req, run, start, started, until


class Hook(FinishHook):
    """Leases every prompt's pages for `lease_s` (None: no lease); asks for hidden rows."""

    def __init__(self, lease_s: float | None = None, hidden: bool = False):
        self.lease_s, self.hidden = lease_s, hidden
        self.leases: list[Lease] = []
        self.seen: list[tuple[list[int], torch.Tensor | None]] = []  # (pages, hidden)

    def wants_hidden(self, prompt) -> bool:
        return self.hidden and prompt.num_tokens % 2 == 0  # even-length prompts only

    def on_finish(self, prompt, result, hidden, keep) -> None:
        self.seen.append((list(prompt.pages), hidden))
        if self.lease_s is not None:
            self.leases.append(keep(self.lease_s))


def core(**kw) -> EngineCore:
    return EngineCore(engine_cfg(**kw), loaded=tiny_loaded(seed=5))


async def scheduler(engine, hook: Hook) -> Scheduler:
    s = Scheduler(lambda: engine, max_queue=16, max_batch_prompts=8, finish_hook=hook)
    await start(s)
    return s


def test_leased_pages_stay_held_shared_with_the_prefix_cache_until_released() -> None:
    eng, hook = core(), Hook(lease_s=60.0)
    alloc = eng.pool.allocator
    ids = prompts(eng.model_cfg.vocab_size, [23], seed=1)[0]  # 6 pages of 4 tokens

    async def main():
        s = await scheduler(eng, hook)
        first = req(ids[:20])  # 5 full pages, published to the prefix cache
        s.submit([first])
        await first.future
        lease = hook.leases[0]
        assert len(lease.pages) == 5 and lease.tokens == 20
        assert s.kv_used_tokens == 5 * PAGE  # held, not merely cached
        assert s.cache.available_pages == alloc.capacity - 5  # neither free nor evictable
        st = s.stats()
        assert (st.kv_leased_pages, st.kv_leased_tokens, st.leases_expired) == (5, 20, 0)
        again = req(ids)  # the leased prompt's prefix: a cache hit on the leased pages
        s.submit([again])
        assert (await again.future).cached_tokens == 20
        assert hook.seen[1][0][:5] == lease.pages
        for held in list(hook.leases):  # released from another thread, as a decode's notice
            t = threading.Thread(target=held.release)
            t.start()
            t.join()
        await until(lambda: s.kv_used_tokens == 0, "the released pages")
        assert s.stats().kv_leased_pages == 0 and s.stats().leases_expired == 0
        lease.release()  # a second release is a no-op
        s.stop()
        assert alloc.num_free == alloc.capacity

    run(main())


def test_an_expired_lease_frees_its_pages_and_counts() -> None:
    eng, hook = core(), Hook(lease_s=0.2)
    alloc = eng.pool.allocator

    async def main():
        s = await scheduler(eng, hook)
        r = req(prompts(eng.model_cfg.vocab_size, [13], seed=2)[0])
        s.submit([r])
        await r.future
        assert s.stats().kv_leased_pages == 4
        await until(lambda: s.stats().leases_expired == 1, "the lease's expiry")  # idle loop
        assert s.kv_used_tokens == 0 and s.stats().kv_leased_pages == 0
        hook.leases[0].release()  # after expiry: nothing to free twice
        s.stop()
        assert alloc.num_free == alloc.capacity

    run(main())


def test_shutdown_drops_live_leases_and_a_cancelled_prompt_takes_none() -> None:
    eng, hook = core(), Hook(lease_s=60.0)

    async def main():
        s = await scheduler(eng, hook)
        r = req(prompts(eng.model_cfg.vocab_size, [9], seed=3)[0])
        s.submit([r])
        await r.future
        assert s.stats().kv_leased_pages == 3
        s.stop()
        assert eng.pool.allocator.num_free == eng.pool.allocator.capacity
        hook.leases[0].release()  # outlived shutdown: dropped already

    run(main())

    fake, hook = FakeEngine(pages=8, page_size=4, budget=5), Hook(lease_s=60.0)

    async def cancelled():
        fake.free_run = False
        s = await started(fake, finish_hook=hook)
        r = req(list(range(20, 32)))  # three forwards of 5, 5, 2 tokens
        s.submit([r])
        await until(lambda: len(fake.calls) == 1, "the first chunk's forward")
        s.cancel(r)
        for _ in range(3):
            fake.permits.release()
        await until(lambda: s.running == 0, "the cancelled prompt's release")
        assert hook.seen == [] and hook.leases == [] and s.kv_used_tokens == 0
        s.stop()
        assert fake.pool.used_tokens == 0

    run(cancelled())


def test_the_hook_reads_the_last_tokens_final_hidden_row() -> None:
    eng, hook = core(max_prefill_tokens=16), Hook(hidden=True)
    even, odd = prompts(eng.model_cfg.vocab_size, [40, 7], seed=4)  # even: three chunks

    async def main():
        s = await scheduler(eng, hook)
        a, b = req(even), req(odd)
        s.submit([a, b])
        await a.future, await b.future
        s.stop()

    run(main())
    got = {len(pages): h for pages, h in hook.seen}
    assert got[2] is None  # the 7-token prompt did not ask
    hidden = got[10]
    assert hidden.shape == (eng.model_cfg.hidden_size,) and hidden.device.type == "cpu"
    ref = reference_hidden(eng, even)
    torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():  # the LM head of that row: the prompt's last logits
        logits = hidden.float() @ eng.model.head_weight.float().T
    torch.testing.assert_close(logits, eng.prefill_chunked(even), atol=1e-4, rtol=1e-4)


def reference_hidden(eng: EngineCore, ids: list[int]) -> torch.Tensor:
    """The model's eager forward of the whole prompt at once: its normed last row."""
    pages = eng.pool.allocator.alloc(-(-len(ids) // PAGE))
    try:
        out = eng.runners[-1].run([SeqChunk(ids, 0, pages, hidden=True)], eng.pool.cache)
        return out[1].hidden[-1]
    finally:
        eng.pool.allocator.free(pages)


def test_no_hook_means_no_hidden_rows_in_the_forward() -> None:
    eng = core()
    ids = prompts(eng.model_cfg.vocab_size, [10], seed=6)[0]
    pages = eng.pool.allocator.alloc(3)
    _, batch, _ = eng.runners[-1].run([SeqChunk(ids, 0, pages)], eng.pool.cache)
    assert batch.hidden is None and eng.forward([SeqChunk(ids, 0, pages)]).hidden == {}
