"""Scheduler policy with a fake engine: FIFO admission, budgets, chunking, pages, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from service.engine.core import ForwardOutput
from service.engine.interface import (
    EngineInfo,
    ForwardFailed,
    KVPoolExhausted,
    NotReady,
    QueueFull,
    SamplingParams,
)
from service.engine.kv_pool import PageAllocator
from service.engine.prompt import Prompt
from service.engine.sampling import last_rows
from service.engine.scheduler import Scheduler
from tests.engine.helpers import tiny_cfg

V = 64


class FakePool:
    def __init__(self, pages: int, page_size: int):
        self.allocator = PageAllocator(pages + 1)
        self.page_size = page_size
        self.calls: list = []  # the engine's forwards
        self.copies: list[tuple[int, list[int], list[int]]] = []

    def copy_pages(self, src, dst):
        self.copies.append((len(self.calls), list(src), list(dst)))  # before forward n

    @property
    def used_tokens(self) -> int:
        return (self.allocator.capacity - self.allocator.num_free) * self.page_size


class FakeEngine:
    """Logits put 5.0 on (token + 1) % V; forwards wait for a permit unless `free_run`."""

    def __init__(self, pages: int = 8, page_size: int = 4, budget: int = 16):
        self.pool = FakePool(pages, page_size)
        self.max_batch_tokens = budget
        self.calls: list[list] = []
        self.pool.calls = self.calls
        self.permits = threading.Semaphore(0)
        self.synchronous = False  # plays a GPU: the scheduler overlaps its forwards
        self.model_cfg = tiny_cfg()  # sizes the chunks of a synchronous engine
        self.seconds = 0.001  # what each forward reports it took
        self.free_run = True
        self.fail_token: int | None = None
        self.closed = False

    def forward(self, chunks):
        self.calls.append(list(chunks))
        if not self.free_run:
            assert self.permits.acquire(timeout=5), "test never released this forward"
        if self.fail_token is not None and any(self.fail_token in c.token_ids for c in chunks):
            raise RuntimeError("boom")
        out = []
        for c in chunks:
            rows = c.token_ids if c.all_logits else c.token_ids[-1:]
            logits = torch.zeros(len(rows), V)
            logits[torch.arange(len(rows)), torch.tensor([(t + 1) % V for t in rows])] = 5.0
            out.append(logits)
        return ForwardOutput(out, last_rows(torch.cat([x[-1:] for x in out])), "eager",
                             self.seconds)

    def launch(self, chunks):
        out = self.forward(chunks)
        return SimpleNamespace(wait=lambda: out, ready=lambda: True)

    def info(self) -> EngineInfo:
        pool = self.pool
        return EngineInfo("fake", "llama", V, 4096, pool.page_size,
                          pool.allocator.capacity * pool.page_size, None)

    def close(self) -> None:
        self.closed = True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def start(s: Scheduler) -> asyncio.Future:
    """Start `s`; the future resolves once the engine loaded (or fails with why not)."""
    loop = asyncio.get_running_loop()
    loaded = loop.create_future()

    def on_loaded(exc: BaseException | None) -> None:
        def settle() -> None:
            if not loaded.done():
                loaded.set_exception(exc) if exc else loaded.set_result(None)
        loop.call_soon_threadsafe(settle)

    s.start(on_loaded)
    return loaded


async def started(engine: FakeEngine, **kw) -> Scheduler:
    kw.setdefault("max_queue", 16)
    kw.setdefault("max_batch_prompts", 8)
    s = Scheduler(lambda: engine, **kw)
    await start(s)
    return s


def settled() -> tuple[asyncio.Future, Callable]:
    """A future on the running loop and the OnDone (any thread) that settles it."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def on_done(result, exc) -> None:
        def settle() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc else fut.set_result(result)
        loop.call_soon_threadsafe(settle)
    return fut, on_done


def req(ids, **params) -> Prompt:
    """A prompt whose `future` (on the running loop) gets its result or error."""
    fut, on_done = settled()
    p = Prompt(list(ids), SamplingParams(**params), on_done)
    p.future = fut
    return p


async def until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_batches_and_results() -> None:
    async def main():
        eng = FakeEngine()
        s = await started(eng)
        a, b = req([1, 2, 3]), req([10, 11])
        s.submit([a, b])
        ra, rb = await a.future, await b.future
        assert (ra.next.token.id, rb.next.token.id) == (4, 12)
        assert ra.prompt_tokens == 3 and ra.cached_tokens == 0 and ra.prompt_logprobs is None
        assert len(eng.calls) == 1 and len(eng.calls[0]) == 2  # one forward, both prompts
        assert s.kv_used_tokens == 0
        s.stop()
        assert eng.closed and eng.pool.used_tokens == 0

    run(main())


def test_chunked_prefill_and_prompt_logprobs() -> None:
    async def main():
        eng = FakeEngine(pages=8, page_size=4, budget=5)
        s = await started(eng)
        ids = list(range(20, 32))  # 12 tokens -> chunks of 5, 5, 2
        r = req(ids, prompt_logprobs=True, top_logprobs=2)
        s.submit([r])
        res = await r.future
        chunks = [c[0] for c in eng.calls]
        assert [(c.prefix_len, len(c.token_ids)) for c in chunks] == [(0, 5), (5, 5), (10, 2)]
        assert [len(c.pages) for c in chunks] == [2, 3, 3]
        assert len({c.pages[0] for c in chunks}) == 1  # the same pages throughout
        assert res.next.token.id == 32
        assert [p.token.id for p in res.prompt_logprobs] == ids[1:]
        assert all(p.top[0].id == p.token.id for p in res.prompt_logprobs)
        s.stop()

    run(main())


def test_token_budget_and_prompt_cap() -> None:
    async def main():
        eng = FakeEngine(pages=32, budget=8)
        s = await started(eng, max_batch_prompts=2)
        rs = [req([i + 1] * 3) for i in range(5)]
        s.submit(rs)
        await asyncio.gather(*(r.future for r in rs))
        for call in eng.calls:
            assert len(call) <= 2 and sum(len(c.token_ids) for c in call) <= 8
        s.stop()

    run(main())


def test_fifo_large_prompt_is_not_starved() -> None:
    async def main():
        eng = FakeEngine(pages=4, page_size=4, budget=64)
        eng.free_run = False
        s = await started(eng)
        small1 = req([1] * 8)  # 2 pages
        s.submit([small1])
        await until(lambda: len(eng.calls) == 1, "first forward")
        big, small2 = req([2] * 16), req([3] * 4)  # big needs all 4 pages
        s.submit([big, small2])
        eng.permits.release()
        await small1.future
        await until(lambda: len(eng.calls) == 2, "second forward")
        assert [c.token_ids[0] for c in eng.calls[1]] == [2], "small2 overtook the big prompt"
        eng.permits.release()
        await big.future
        eng.permits.release()
        await small2.future
        s.stop()

    run(main())


def test_admission_errors() -> None:
    async def main():
        eng = FakeEngine(pages=4, page_size=4)
        eng.free_run = False
        s = await started(eng, max_queue=2)
        with pytest.raises(KVPoolExhausted, match="needs 5 KV pages; the pool has 4"):
            s.submit([req([1] * 17)])
        first = req([1])
        s.submit([first])
        await until(lambda: len(eng.calls) == 1, "running")
        s.submit([req([2])])
        with pytest.raises(QueueFull, match="1 prompts queued, limit 2"):
            s.submit([req([3]), req([4])])  # all or nothing
        assert s.queue_depth == 1
        eng.permits.release(4)
        await first.future
        s.stop()

    run(main())


def test_not_ready_and_stop_fail_pending() -> None:
    async def main():
        gate = threading.Event()
        eng = FakeEngine()
        s = Scheduler(lambda: gate.wait(5) and eng, max_queue=4, max_batch_prompts=4)
        loaded = start(s)
        with pytest.raises(NotReady, match="loading"):
            s.submit([req([1])])
        gate.set()
        await loaded
        eng.free_run = False
        r1, r2 = req([1]), req([2] * 8)
        s.submit([r1])
        await until(lambda: eng.calls, "running")
        s.submit([r2])
        await asyncio.to_thread(s.stop, 0.2)  # r1's forward is still blocked
        for r in (r1, r2):
            with pytest.raises(NotReady, match="shutting down"):
                await r.future
        eng.permits.release(2)
        assert s.state == "stopped"

    run(main())


def test_load_failure() -> None:
    async def main():
        def broken():
            raise OSError("disk on fire")

        s = Scheduler(broken, max_queue=4, max_batch_prompts=4)
        with pytest.raises(RuntimeError, match="disk on fire"):
            await start(s)
        assert s.state == "failed" and "OSError: disk on fire" in s.error and not s.alive

    run(main())


def test_forward_failure_fails_only_its_batch() -> None:
    async def main():
        eng = FakeEngine()
        eng.fail_token = 13
        eng.free_run = False
        s = await started(eng)
        bad = req([13, 14])
        s.submit([bad])
        await until(lambda: eng.calls, "bad forward")
        good = req([5, 6])
        s.submit([good])
        eng.permits.release(2)
        with pytest.raises(ForwardFailed, match="RuntimeError: boom"):
            await bad.future
        assert (await good.future).next.token.id == 7
        assert s.kv_used_tokens == 0 and s.alive
        s.stop()

    run(main())


def test_cancel_queued_never_runs_and_running_frees_pages() -> None:
    async def main():
        eng = FakeEngine(budget=4)
        eng.free_run = False
        s = await started(eng)
        running = req([1] * 10)  # 3 chunks of 4, 4, 2
        s.submit([running])
        await until(lambda: eng.calls, "first chunk")
        queued = req([50, 51])
        s.submit([queued])
        s.cancel(queued)
        s.cancel(running)
        assert s.queue_depth == 0 and queued.cancelled
        assert s.kv_used_tokens > 0  # its forward is still running
        eng.permits.release()
        await until(lambda: s.kv_used_tokens == 0, "pages freed after the forward")
        eng.permits.release(5)
        await asyncio.sleep(0.05)
        assert len(eng.calls) == 1, "a cancelled prompt was scheduled again"
        assert not queued.future.done() and not running.future.done()  # never answered
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())


def test_logprob_prompts_wait_for_logit_rows_before_taking_pages() -> None:
    async def main():
        eng = FakeEngine(pages=16, page_size=4, budget=64)
        eng.free_run = False
        s = await started(eng, max_logit_rows=4)
        rs = [req(list(range(1 + 10 * i, 9 + 10 * i)), prompt_logprobs=True) for i in range(5)]
        s.submit(rs)
        await until(lambda: len(eng.calls) == 1, "the first forward")
        # one 4-row chunk fits this forward: only its prompt (2 pages) may hold KV pages
        assert eng.calls[0][0].num_tokens == 4 and len(eng.calls[0]) == 1
        assert s.kv_used_tokens == 8, s.kv_used_tokens
        eng.free_run = True
        eng.permits.release()
        out = await asyncio.gather(*(r.future for r in rs))
        assert all(len(o.prompt_logprobs) == 7 for o in out)
        assert s.kv_used_tokens == 0
        s.stop()

    run(main())


class OverlapEngine(FakeEngine):
    """Logs when each forward is launched and when its results are read."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.events: list[str] = []

    def launch(self, chunks):
        n = len(self.calls) + 1
        out = self.forward(chunks)
        self.events.append(f"launch {n}")

        def wait():
            self.events.append(f"wait {n}")
            return out
        return SimpleNamespace(wait=wait, ready=lambda: True)


def test_the_next_forward_is_launched_before_the_last_is_read() -> None:
    """Chunks of one prompt and a second prompt in consecutive forwards: forward n + 1 is
    launched before forward n's results are read, and each prompt still gets its own answer
    (a chunked prompt's logprobs stay in order)."""
    async def main():
        eng = OverlapEngine(pages=16, page_size=4, budget=5)
        s = await started(eng)
        long_ids = list(range(20, 32))  # chunks of 5, 5, 2 tokens
        a = req(long_ids, prompt_logprobs=True)
        b = req([40, 41, 42])
        s.submit([a, b])
        ra, rb = await a.future, await b.future
        assert eng.events[:3] == ["launch 1", "launch 2", "wait 1"]
        assert eng.events.index("launch 3") < eng.events.index("wait 2")
        assert ra.next.token.id == 32 and rb.next.token.id == 43
        assert [p.token.id for p in ra.prompt_logprobs] == long_ids[1:]
        await until(lambda: s.kv_used_tokens == 0, "the pages to be freed")
        s.stop()

    run(main())


def test_a_synchronous_engine_answers_each_forward_before_running_the_next() -> None:
    """On the CPU a launch runs the whole forward: a short prompt's answer must not wait for a
    long prompt that arrived while it ran (the overlap of the GPU path would hold it back)."""
    async def main():
        eng = OverlapEngine(pages=16, page_size=4, budget=16)
        eng.synchronous, eng.free_run = True, False
        s = await started(eng)
        short = req([1, 2, 3])
        s.submit([short])
        await until(lambda: len(eng.calls) == 1, "the short prompt's forward")
        long_ = req(list(range(10, 26)))
        s.submit([long_])
        eng.permits.release()  # the short prompt's forward ends; the long one's then blocks
        await until(lambda: len(eng.calls) == 2, "the long prompt's forward")
        done = await asyncio.wait_for(short.future, 2)  # while the long forward still runs
        assert done.next.token.id == 4 and not long_.future.done()
        eng.free_run = True
        eng.permits.release()
        assert (await long_.future).next.token.id == 26
        assert eng.events == ["launch 1", "wait 1", "launch 2", "wait 2"]
        s.stop()

    run(main())
