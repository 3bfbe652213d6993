"""Chunk sizes where a launch runs a whole forward (the CPU): a long prompt goes in slices, so a
cancel stops it, and a short prompt gets in, at the next slice's boundary."""

from __future__ import annotations

import asyncio

from service.engine.batch import SeqChunk
from service.engine.chunk_size import MIN_TOKENS, SLICE_S, ChunkSizer
from tests.engine.helpers import tiny_cfg
from tests.engine.test_scheduler import FakeEngine, req, run, started, until


def test_a_slice_shrinks_with_the_prefix_and_follows_the_measured_rate() -> None:
    sizer = ChunkSizer(tiny_cfg())
    assert sizer.cap(0) == MIN_TOKENS  # nothing measured yet
    sizer.measured([SeqChunk(tuple(range(500)), 0, ())], SLICE_S)
    assert abs(sizer.cap(0) - 500) <= 1 and MIN_TOKENS < sizer.cap(4000) < 499
    assert sizer.work(sizer.cap(4000), 4000) <= sizer.rate * SLICE_S
    sizer.measured([SeqChunk(tuple(range(500)), 0, ())], 3 * SLICE_S)  # the host got slower
    assert sizer.cap(0) < 500
    assert ChunkSizer(tiny_cfg()).cap(10**6) == MIN_TOKENS


def test_a_long_prompt_on_a_synchronous_engine_stops_or_lets_a_short_one_in_per_slice() -> None:
    async def main():
        eng = FakeEngine(pages=200, page_size=4, budget=1024)
        eng.synchronous, eng.free_run, eng.seconds = True, False, 100.0  # a slow host
        s = await started(eng)
        long_ = req(range(600))
        s.submit([long_])
        await until(lambda: eng.calls, "the first slice")
        short = req([1, 2, 3])
        s.submit([short])
        eng.permits.release()
        await until(lambda: len(eng.calls) == 2, "the second slice")
        assert [(c.prefix_len, c.num_tokens) for c in eng.calls[1]] == [(MIN_TOKENS, MIN_TOKENS),
                                                                        (0, 3)]
        s.cancel(long_)
        eng.permits.release(5)
        assert (await short.future).next.token.id == 4
        await until(lambda: s.kv_used_tokens == 0, "the long prompt's pages freed")
        await asyncio.sleep(0.05)
        assert len(eng.calls) == 2, "the cancelled prompt ran past its slice"
        assert not long_.future.done()  # its canceller answers it
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())
