"""The engine's server loop over real ZeroMQ sockets: batching across workers, cancellation when a
worker goes, bytes that are not a message, prompts that share a prefix."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from service.api.engine_client import EngineClient
from service.engine import messages as m
from service.engine.interface import SamplingParams
from service.engine.scheduler import Scheduler
from tests.api.conftest import EngineThread, TestEngine, wait_for


def engine_thread(core: Any, max_batch_tokens: int | None = None,
                  **kw: Any) -> tuple[EngineThread, TestEngine]:
    test_engine = TestEngine(core, max_batch_tokens)
    thread = EngineThread(lambda on_queue, poll: Scheduler(
        lambda: test_engine, max_queue=64, max_batch_prompts=64, on_queue=on_queue, poll=poll,
        **kw))
    return thread, test_engine


async def connected(thread: EngineThread, worker: int) -> EngineClient:
    client = EngineClient(thread.addrs, worker, max_queue=64)
    await client.start()
    for _ in range(500):
        if client.state == "ready":
            return client
        await asyncio.sleep(0.01)
    raise AssertionError(f"worker {worker} never saw the engine ready")


def test_prompts_from_different_workers_share_a_forward(core) -> None:
    thread, eng = engine_thread(core)

    async def main() -> None:
        a, b = await connected(thread, 0), await connected(thread, 1)
        eng.delay_s = 0.5
        _, first = a.submit([[1, 2, 3]], SamplingParams())
        await asyncio.sleep(0.2)  # the first forward is under way: the next two queue
        _, from_a = a.submit([[4, 5, 6, 7]], SamplingParams())
        _, from_b = b.submit([[8, 9]], SamplingParams())
        results = await asyncio.gather(first, from_a, from_b)
        assert [r[0].prompt_tokens for r in results] == [3, 4, 2]
        await a.close()
        await b.close()

    try:
        asyncio.run(main())
        # one forward, both workers' prompts (in either order: two sockets, no order between them)
        assert {(4, 5, 6, 7), (8, 9)} in [set(f) for f in eng.forwards]
    finally:
        thread.close()


def test_a_gone_worker_has_its_requests_cancelled(core) -> None:
    thread, eng = engine_thread(core, max_batch_tokens=16)

    async def main() -> None:
        a = await connected(thread, 0)
        eng.delay_s = 0.3
        a.submit([list(range(100, 164))], SamplingParams())  # four forwards of 16 tokens
        a.submit([[4, 5, 6]], SamplingParams())
        await asyncio.sleep(0.1)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(thread.addrs.inbox)
        push.send(m.encode(m.WorkerGone(0)))
        push.close(linger=1000)
        await a.close()

    try:
        asyncio.run(main())
        wait_for(lambda: thread.scheduler.in_flight == 0, 10, "the engine to drop both")
        assert thread.scheduler.kv_used_tokens == 0 and thread.server.requests == {}
        # the forward under way and the one launched behind it, nothing after them
        assert len(eng.forwards) <= 2
    finally:
        thread.close()


def test_a_new_worker_knows_the_engine_state_before_it_serves(core) -> None:
    """start() returns once the engine's Status came: a worker that replaces a dead one takes
    no request while it still thinks the engine is loading. A silent engine holds it only
    for the wait it is given."""
    thread, _ = engine_thread(core)

    async def main() -> None:
        first = await connected(thread, 0)  # the engine has loaded
        late = EngineClient(thread.addrs, 1, max_queue=64)
        await late.start()
        assert late.state == "ready" and late.admission_error() is None
        thread.silence()
        mute = EngineClient(thread.addrs, 2, max_queue=64)
        await asyncio.wait_for(mute.start(wait_s=0.3), 5)
        assert mute.state == "loading" and "loading" in str(mute.admission_error())
        for c in (first, late, mute):
            await c.close()

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_bytes_that_are_not_a_message_are_dropped(core) -> None:
    """A pickle (or anything else) is not decoded as anything but msgpack, and the loop goes on."""
    import pickle

    thread, _ = engine_thread(core)

    async def main() -> None:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(thread.addrs.inbox)
        push.send(pickle.dumps(OSError("payload")))
        push.send(b"\xc1")
        push.send(m.encode(m.Cancel(5, [1, 2])))  # nothing to cancel: ignored
        push.close(linger=1000)
        client = await connected(thread, 1)
        rid, fut = client.submit([[1, 2, 3]], SamplingParams())
        assert (await fut)[0].prompt_tokens == 3
        await client.close()

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_a_submit_sharing_a_prefix_carries_the_rest_once(core) -> None:
    """With `shared`, prompts after the first travel as their own tokens; the engine rebuilds
    them, prefills the shared tokens once, and refuses a Submit whose prompts share nothing."""
    thread, eng = engine_thread(core)

    async def main() -> None:
        client = await connected(thread, 0)
        query = list(range(40, 80))
        prompts = [query + [7, 8], query + [9], query + [10, 11, 12]]
        _, fut = client.submit(prompts, SamplingParams(), shared=len(query))
        grouped = await fut
        _, fut = client.submit(prompts, SamplingParams())
        apart = await fut
        assert [r.next.token.id for r in grouped] == [r.next.token.id for r in apart]
        for g, a in zip(grouped, apart):
            assert abs(g.next.token.logprob - a.next.token.logprob) < 1e-4
        assert [r.prompt_tokens for r in grouped] == [42, 41, 43]
        assert [r.cached_tokens for r in grouped] == [40, 40, 40]
        bad = m.Submit(0, 999, [m.pack_ids(query), m.pack_ids([7])], SamplingParams(), [], 40)
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(thread.addrs.inbox)
        sock.send(m.encode(bad))
        fut = asyncio.get_running_loop().create_future()
        client._pending[999] = fut  # the reply to the hand-made Submit
        with_error = await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 10)
        assert "tokens of its own" in str(with_error[0])
        sock.close(0)
        await client.close()

    try:
        asyncio.run(main())
        # the grouped request: the query's 40 tokens, then the items' 6 in the next forward
        assert [sum(map(len, f)) for f in eng.forwards[:2]] == [40, 6]
    finally:
        thread.close()
