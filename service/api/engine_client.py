"""A worker's handle on the engine process (submit, cancel, state, stats) over ZeroMQ. Its death
is seen at once: the `alive` pipe's other end, held only by the engine, closes with it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np
import zmq
import zmq.asyncio

from service.engine import messages as m
from service.engine.board import QueueBoard
from service.engine.interface import (
    SHUTTING_DOWN,
    EngineInfo,
    EngineStats,
    EngineTimeout,
    NotReady,
    PromptResult,
    SamplingParams,
    admission_error,
)
from service.engine.pages import page_keys

log = logging.getLogger(__name__)

HELLO_EVERY_S = 0.2  # until the engine answers with its state (its ROUTER may not know us yet)
FIRST_STATUS_S = 5.0  # a worker waits this long for the engine's state before it takes requests
STATS_TIMEOUT_S = 1.0
AUDIT_EVERY_S = 2.0  # requests unanswered this long are audited, this often
GONE = "the engine process is gone; retry on another replica"


class EngineClient:
    def __init__(self, addrs: m.Addresses, worker: int, *, max_queue: int,
                 alive: Connection | None = None, key_page_size: int = 0,
                 request_timeout_s: float = 600.0, audit_every_s: float = AUDIT_EVERY_S):
        self.addrs, self.worker, self.max_queue, self._alive = addrs, worker, max_queue, alive
        # every request gets an answer: the engine's, a `dropped` one when an Audit finds the
        # engine does not hold it, or a 504 once it has waited request_timeout_s
        self.request_timeout_s, self.audit_every_s = request_timeout_s, audit_every_s
        # pages of this size get their prefix-cache keys here, off the engine; 0: cache is off
        self.key_page_size = key_page_size
        self.state = "loading"  # the engine's: loading | ready | failed | stopped | dead
        self.error: str | None = None
        self.info: EngineInfo | None = None
        self.last_stats = EngineStats()
        self._board: QueueBoard | None = None
        self._pending: dict[int, asyncio.Future[list[PromptResult]]] = {}
        self._sent: dict[int, float] = {}  # rid -> when it was submitted (monotonic)
        self._queries: dict[int, asyncio.Future[EngineStats]] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.Context | None = None
        self._heard = asyncio.Event()  # the engine's first Status (or its death) came

    async def start(self, wait_s: float = FIRST_STATUS_S) -> None:
        """Connect, then wait up to `wait_s` for the engine's state: a worker that replaces a
        dead one must not answer "engine is loading" while the engine is ready. The engine's
        main thread answers within milliseconds, also while it loads; past `wait_s` the worker
        serves with the state it has."""
        loop = asyncio.get_running_loop()
        self._board = QueueBoard(self.addrs.board)
        self._ctx = ctx = zmq.Context()
        self._push, self._control = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        for sock, addr in ((self._push, self.addrs.inbox), (self._control, self.addrs.control)):
            sock.setsockopt(zmq.SNDHWM, 0)  # never blocks; the engine reads as fast as it can
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
        self._dealer = zmq.asyncio.Context.shadow(ctx).socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.ROUTING_ID, m.routing_id(self.worker))
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(self.addrs.outbox)
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._greet()),
                       loop.create_task(self._watch())]
        if self._alive is not None:
            loop.add_reader(self._alive.fileno(), self._engine_gone)
        try:
            await asyncio.wait_for(self._heard.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("no word from the engine in %gs: serving as %s", wait_s, self.state)

    async def close(self) -> None:
        if self._alive is not None and self.state != "dead":
            asyncio.get_running_loop().remove_reader(self._alive.fileno())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(NotReady(SHUTTING_DOWN))
        if self._ctx is not None:
            self._push.close(0)
            self._control.close(0)
            self._dealer.close(0)
            self._ctx.term()
        if self._board is not None:
            self._board, board = None, self._board
            board.close()

    @property
    def alive(self) -> bool:
        return self.state in ("loading", "ready")

    def admission_error(self, prompts: int = 1) -> Exception | None:
        """Why `prompts` more prompts would be refused now (the engine's queue board); cheap."""
        if self._board is None and self.state == "ready":
            return NotReady(SHUTTING_DOWN)
        queue, retry_after_s = self._board.read() if self._board is not None else (0, 1)
        return admission_error(self.state, self.error, queue, prompts, self.max_queue,
                               retry_after_s)

    def submit(self, prompts: Sequence[Sequence[int] | np.ndarray], params: SamplingParams,
               shared: int = 0) -> tuple[int, asyncio.Future[list[PromptResult]]]:
        """`shared` > 0: every prompt starts with the same `shared` tokens, prefilled once."""
        if self.state != "ready":
            raise NotReady(GONE if self.state == "dead" else f"engine is {self.state}")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._sent[rid] = time.monotonic()
        ps = self.key_page_size
        if not ps:
            keys = []
        elif shared:  # only the shared query's pages are looked up and published
            keys = [b"".join(page_keys(prompts[0][:shared], ps))] + [b""] * (len(prompts) - 1)
        else:
            keys = [b"".join(page_keys(p, ps)) for p in prompts]
        packed = [m.pack_ids(p if i == 0 or not shared else p[shared:])
                  for i, p in enumerate(prompts)]
        self._send(m.Submit(self.worker, rid, packed, params, keys, shared))
        return rid, fut

    def cancel(self, rid: int) -> None:
        """The client is gone: the engine drops the request and frees its pages."""
        if self._take(rid) is not None:
            self._send(m.Cancel(self.worker, [rid]))

    def abort(self, exc: BaseException) -> int:
        """Fail every request in flight with `exc` and cancel them in the engine."""
        rids = list(self._pending)
        self._fail_all(exc)
        if rids:
            self._send(m.Cancel(self.worker, rids))
        return len(rids)

    async def stats(self) -> EngineStats:
        """The engine's live numbers; the last known ones if it does not answer in time."""
        if self.state not in ("loading", "ready"):
            return self.last_stats
        qid = next(self._ids)
        fut = self._queries[qid] = asyncio.get_running_loop().create_future()
        self._control.send(m.encode(m.StatsQuery(self.worker, qid)), zmq.NOBLOCK)
        try:
            return await asyncio.wait_for(fut, STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self.last_stats
        finally:
            self._queries.pop(qid, None)

    def _send(self, msg: m.ToEngine) -> None:
        self._push.send(m.encode(msg), zmq.NOBLOCK)

    def _take(self, rid: int) -> asyncio.Future[list[PromptResult]] | None:
        self._sent.pop(rid, None)
        return self._pending.pop(rid, None)

    async def _watch(self) -> None:
        """Every `audit_every_s`: requests past their deadline get a 504 and are cancelled;
        the rest unanswered since the last look are audited (an Audit travels behind their
        Submits and its answers behind their Dones, so an answer on its way is never lost)."""
        while True:
            await asyncio.sleep(self.audit_every_s)
            if self.state != "ready":
                continue
            now = time.monotonic()
            late, audit = [], []
            for rid in self._pending:
                age = now - self._sent.setdefault(rid, now)
                if age >= self.request_timeout_s:
                    late.append(rid)
                elif age >= self.audit_every_s:
                    audit.append(rid)
            for rid in late:
                fut = self._take(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(EngineTimeout(
                        f"the engine did not answer within {self.request_timeout_s:g} s "
                        "(REQUEST_TIMEOUT_S); the request was cancelled"))
            if late:
                self._send(m.Cancel(self.worker, late))
            if audit:
                self._send(m.Audit(self.worker, audit))

    async def _greet(self) -> None:
        while self.state == "loading":
            self._control.send(m.encode(m.Hello(self.worker)), zmq.NOBLOCK)
            await asyncio.sleep(HELLO_EVERY_S)

    async def _read(self) -> None:
        while True:
            data = await self._dealer.recv()
            try:
                msg = m.to_worker(data)
            except Exception:  # noqa: BLE001 - never expected; logged, not fatal
                log.exception("undecodable reply (%d bytes) dropped", len(data))
                continue
            if isinstance(msg, m.Done):
                fut = self._take(msg.rid)
                if fut is None or fut.done():
                    continue  # cancelled meanwhile
                if msg.failure is not None:
                    fut.set_exception(m.exception(msg.failure))
                else:
                    fut.set_result(msg.results or [])
            elif isinstance(msg, m.StatsReply):
                self.last_stats = msg.stats
                if (q := self._queries.pop(msg.qid, None)) is not None and not q.done():
                    q.set_result(msg.stats)
            elif isinstance(msg, m.Status) and self.state != "dead":
                self._set_state(msg)

    def _set_state(self, msg: m.Status) -> None:
        self._heard.set()
        if msg.info is not None:
            self.info = msg.info
        if msg.state != self.state:
            log.debug("engine state %s -> %s", self.state, msg.state)
        self.state, self.error = msg.state, msg.error
        if msg.state not in ("loading", "ready"):
            self._fail_all(NotReady(f"engine is {msg.state}"
                                    + (f": {msg.error}" if msg.error else "")))

    def _engine_gone(self) -> None:
        assert self._alive is not None
        asyncio.get_running_loop().remove_reader(self._alive.fileno())
        if self.state in ("loading", "ready"):
            log.warning("the engine process is gone: answering 503")
        self.state, self.error = "dead", "the engine process is gone"
        self._heard.set()
        self._fail_all(NotReady(GONE))

    def _fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        self._sent.clear()
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: an abandoned future must not log
        queries, self._queries = self._queries, {}
        for q in queries.values():
            if not q.done():
                q.set_result(self.last_stats)
