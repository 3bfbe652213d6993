"""The engine under messages no correct worker sends (malformed, forged, oversized, lost): it
keeps serving, each request it can address gets an answer, a bad prompt fails alone, and a
worker answers every request whatever becomes of its messages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest
import zmq

from service.api.engine_client import EngineClient
from service.engine import messages as m
from service.engine.interface import (
    EngineTimeout,
    InvalidRequest,
    RequestDropped,
    SamplingParams,
)
from service.engine.scheduler import Scheduler
from tests.api.conftest import EngineThread, TestEngine

VOCAB = 49152  # the embedded SmolLM2's


def engine_thread(core: Any, **kw: Any) -> tuple[EngineThread, TestEngine]:
    test_engine = TestEngine(core)
    thread = EngineThread(lambda on_queue, poll: Scheduler(
        lambda: test_engine, max_queue=64, max_batch_prompts=64, on_queue=on_queue,
        poll=poll), **kw)
    return thread, test_engine


async def connected(thread: EngineThread, worker: int, **kw: Any) -> EngineClient:
    client = EngineClient(thread.addrs, worker, max_queue=64, **kw)
    await client.start()
    assert client.state == "ready"
    return client


def pusher(thread: EngineThread) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(thread.addrs.inbox)
    return sock


def expect(client: EngineClient, rid: int) -> asyncio.Future:
    """A future for the reply to a hand-made Submit with this rid."""
    fut = client._pending[rid] = asyncio.get_running_loop().create_future()
    return fut


def submit_bytes(worker: int, rid: int, prompts: list[bytes], params: dict | None = None,
                 **fields: Any) -> bytes:
    """A Submit as raw msgpack, so that any field can hold what the struct would refuse."""
    raw = msgspec.msgpack.decode(m.encode(m.Submit(worker, rid, prompts, SamplingParams())))
    raw[4].update(params or {})
    for i, name in ((5, "keys"), (6, "shared")):
        if name in fields:
            raw[i] = fields[name]
    return msgspec.msgpack.encode(raw)


def test_malformed_messages_are_answered_and_the_engine_serves_on(core, caplog) -> None:
    """Each bad Submit that names a request gets an InvalidRequest answer; junk, bad types and
    oversized messages are dropped with a few log lines, not one (or a traceback) each; then
    a correct request is served as usual."""
    thread, _ = engine_thread(core, max_message_bytes=1 << 20)
    ids = m.pack_ids([1, 2, 3])
    bad = {
        1: submit_bytes(7, 1, [b"abc"]),  # 3 bytes: no whole int32
        2: submit_bytes(7, 2, []),  # no prompts
        3: submit_bytes(7, 3, [b""]),  # an empty prompt
        4: submit_bytes(7, 4, [m.pack_ids([1, VOCAB + 5])]),  # outside the vocabulary
        5: submit_bytes(7, 5, [m.pack_ids([-3, 4])]),  # negative id
        6: submit_bytes(7, 6, [ids], {"logprob_token_ids": [VOCAB]}),
        7: submit_bytes(7, 7, [ids, ids], shared=9),  # shares more than it holds
        8: submit_bytes(7, 8, [ids], keys=[b"x" * 5]),  # page keys of no page
        9: submit_bytes(7, 9, [m.pack_ids(range(40000))]),  # longer than the engine serves
    }
    dropped = [
        submit_bytes(7, 10, [ids], {"temperature": float("nan")}),
        submit_bytes(7, 11, [ids], {"top_k": (1 << 64) - 1}),
        submit_bytes(7, 12, [ids], {"top_k": -1}),
        msgspec.msgpack.encode(["Submit", "seven", 1, [ids], {}, [], 0]),
        msgspec.msgpack.encode(["Cancel", 7]),
        msgspec.msgpack.encode(["Nope", 1, 2]),
        b"\x00" * 1000,
        b"\xc1",
    ]

    async def main() -> None:
        client = await connected(thread, 7)
        futs = {rid: expect(client, rid) for rid in bad}
        push = pusher(thread)
        for data in bad.values():
            push.send(data)
        for _ in range(50):
            for data in dropped:
                push.send(data)
        for rid, fut in futs.items():
            err = await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 10)
            assert isinstance(err[0], InvalidRequest), (rid, err[0])
        assert "vocabulary" in str(futs[4].exception()) and "-3" in str(futs[5].exception())
        # over the inbox's cap: the sender is cut off, the message never read
        big = pusher(thread)
        big.send(submit_bytes(7, 99, [m.pack_ids(range(300_000))]))
        big.close()
        _, fut = client.submit([[5, 6, 7]], SamplingParams(top_logprobs=2))
        assert (await asyncio.wait_for(fut, 30))[0].prompt_tokens == 3
        push.close()
        await client.close()

    with caplog.at_level(logging.WARNING, logger="service.engine.server"):
        try:
            asyncio.run(main())
            assert thread.thread.is_alive() and thread.scheduler.state == "ready"
            assert thread.scheduler.in_flight == 0 and thread.server.requests == {}
        finally:
            thread.close()
    lines = [r for r in caplog.records if r.name == "service.engine.server"]
    assert 1 <= len(lines) <= 5, [r.getMessage() for r in lines]
    assert not any(r.exc_info for r in lines)


def test_a_bad_prompt_fails_alone_not_its_batch(core) -> None:
    """Four requests queued behind one forward share the next; the one whose ids are outside
    the vocabulary is refused before it, and the other three are answered."""
    thread, eng = engine_thread(core)

    async def main() -> None:
        client = await connected(thread, 0)
        eng.delay_s = 0.4
        _, first = client.submit([[1, 2, 3]], SamplingParams())
        await asyncio.sleep(0.1)
        futs = [client.submit([p], SamplingParams())[1]
                for p in ([4, 5, 6], [7, 8], [VOCAB + 1, 9], [10, 11, 12, 13])]
        out = await asyncio.wait_for(asyncio.gather(first, *futs, return_exceptions=True), 30)
        assert [type(o).__name__ for o in out] == ["list"] * 3 + ["InvalidRequest", "list"]
        await client.close()

    try:
        asyncio.run(main())
        assert {(4, 5, 6), (7, 8), (10, 11, 12, 13)} in [set(f) for f in eng.forwards]
    finally:
        thread.close()


@pytest.mark.parametrize("forged", ["cancel", "worker_gone"])
def test_a_forged_cancel_still_answers_the_request(core, forged: str) -> None:
    """A Cancel or WorkerGone that is not the request's own worker's (the worker still waits)
    drops the request in the engine and answers it, instead of leaving it unanswered."""
    thread, eng = engine_thread(core)

    async def main() -> None:
        client = await connected(thread, 3)
        eng.delay_s = 0.3
        _, busy = client.submit([[1, 2, 3]], SamplingParams())
        rid, victim = client.submit([[4, 5, 6]], SamplingParams())
        for _ in range(500):  # the engine holds both (the forged message comes another way)
            if len(thread.server.requests) == 2:
                break
            await asyncio.sleep(0.01)
        push = pusher(thread)
        push.send(m.encode(m.Cancel(3, [rid]) if forged == "cancel" else m.WorkerGone(3)))
        out = await asyncio.wait_for(asyncio.gather(busy, victim, return_exceptions=True), 10)
        assert isinstance(out[1], RequestDropped)
        push.close()
        await client.close()

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_a_request_the_engine_never_got_is_answered_by_the_audit(core) -> None:
    """A request whose Submit was lost (here: never sent) is found by the worker's audit and
    answered RequestDropped; one the engine holds is left to finish, then answered."""
    thread, eng = engine_thread(core)

    async def main() -> None:
        client = await connected(thread, 0, audit_every_s=0.2)
        lost = expect(client, 12345)
        eng.delay_s = 1.0  # held by the engine across several audits
        _, held = client.submit([[1, 2, 3]], SamplingParams())
        out = await asyncio.wait_for(asyncio.gather(lost, held, return_exceptions=True), 10)
        assert isinstance(out[0], RequestDropped), out[0]
        assert out[1][0].prompt_tokens == 3
        await client.close()

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_a_request_past_its_deadline_gets_a_timeout(core) -> None:
    """An engine that stops answering (alive, but silent) cannot hold a request past
    request_timeout_s: the worker answers EngineTimeout."""
    thread, eng = engine_thread(core)

    async def main() -> None:
        client = await connected(thread, 0, audit_every_s=0.1, request_timeout_s=0.5)
        eng.delay_s = 0.3
        thread.silence()
        _, fut = client.submit([[1, 2, 3]], SamplingParams())
        err = await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 10)
        assert isinstance(err[0], EngineTimeout) and "REQUEST_TIMEOUT_S" in str(err[0])
        await client.close()

    try:
        asyncio.run(main())
    finally:
        thread.close()
