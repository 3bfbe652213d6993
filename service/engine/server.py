"""The engine process: the engine thread reads work itself; the main thread answers control."""

from __future__ import annotations

import logging
import signal
import threading
import time
from functools import partial
from multiprocessing.connection import Connection

import zmq

from service.config import EngineConfig, ServerConfig
from service.engine import messages as m
from service.engine.board import QueueBoard
from service.engine.checks import submit_prompts
from service.engine.finish import FinishHook
from service.engine.interface import (
    InvalidRequest,
    KVPoolExhausted,
    NotReady,
    PromptResult,
    QueueFull,
    RequestDropped,
)
from service.engine.prompt import Prompt, shared_query
from service.engine.scheduler import Scheduler
from service.process import exit_now, freeze_heap, setup_child

log = logging.getLogger(__name__)

HELP_S = 0.005  # a launch this long has the main thread read the work socket meanwhile
STOP_WAIT_S = 1.0
CONTROL_MESSAGE_BYTES = 64 << 10
BAD_MESSAGE_LOG_S = 10.0


class Throttled:
    """One warning line per `every_s` at most, counting what it did not print."""

    def __init__(self, every_s: float):
        self.every_s, self.next_at, self.skipped = every_s, 0.0, 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.skipped += 1
            return
        if self.skipped:
            msg += f" ({self.skipped} more since the last such line)"
        self.next_at, self.skipped = now + self.every_s, 0
        log.warning(msg, *args)


class Outbox:
    def __init__(self, sock: zmq.Socket):
        self._sock, self._lock = sock, threading.Lock()

    def send(self, worker: int, msg: m.ToWorker) -> None:
        data = m.encode(msg)
        with self._lock:
            try:
                self._sock.send_multipart([m.routing_id(worker), data], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the worker is gone or not keeping up: its replies are dropped
                log.debug("reply to worker %d dropped", worker)


class Request:
    """One Submit: its prompts, answered together once every prompt is done or one failed."""

    __slots__ = ("server", "key", "prompts", "results", "left")

    def __init__(self, server: EngineServer, key: tuple[int, int], n: int):
        self.server, self.key = server, key
        self.prompts: list[Prompt] = []
        self.results: list[PromptResult | None] = [None] * n
        self.left = n

    def done(self, i: int, result: PromptResult | None, exc: BaseException | None) -> None:
        """Prompt i's OnDone; i < 0: a shared query's, which reports only a failure."""
        if i < 0 and exc is None:
            return
        if exc is not None:
            self.server.finish(self, None, exc)
            return
        self.results[i] = result
        self.left -= 1
        if self.left == 0:
            self.server.finish(self, self.results, None)


class EngineServer:
    def __init__(self, scheduler: Scheduler, outbox: Outbox):
        self.scheduler, self.outbox = scheduler, outbox
        # (worker, rid) -> Request; whoever pops a key first (reply or cancel) owns its outcome
        self.requests: dict[tuple[int, int], Request] = {}
        self.workers: set[int] = set()
        self._workers_lock = threading.Lock()
        self._inbox_lock = threading.Lock()
        self._bad = Throttled(BAD_MESSAGE_LOG_S)

    def status(self) -> m.Status:
        s = self.scheduler
        return m.Status(s.state, s.error, s.info if s.state == "ready" else None)

    def broadcast_status(self) -> None:
        status = self.status()
        with self._workers_lock:
            workers = list(self.workers)
        for w in workers:
            self.outbox.send(w, status)

    def finish(self, req: Request, results: list[PromptResult | None] | None,
               exc: BaseException | None) -> None:
        if self.requests.pop(req.key, None) is None:
            return
        if exc is not None:
            for p in req.prompts:
                if not p.cancelled:
                    self.scheduler.cancel(p)
        self._reply(req.key, results, exc)

    def _reply(self, key: tuple[int, int], results: list | None,
               exc: BaseException | None) -> None:
        self.outbox.send(key[0], m.Done(key[1], results, m.failure(exc) if exc else None))

    def handle(self, msg: m.ToEngine) -> None:
        """Act on one message; a bad one is logged and, where it names a request, answered."""
        try:
            self._handle(msg)
        except InvalidRequest as e:
            self._bad.warning("refused a %s from worker %s: %s", type(msg).__name__,
                              msg.worker, e)
            if isinstance(msg, m.Submit):
                self._reply((msg.worker, msg.rid), None, e)
        except Exception as e:  # noqa: BLE001 - a bug on a message's path fails that message
            log.exception("a %s from worker %s failed", type(msg).__name__, msg.worker)
            if isinstance(msg, m.Submit) and not self.cancel((msg.worker, msg.rid), e):
                self._reply((msg.worker, msg.rid), None, e)

    def _handle(self, msg: m.ToEngine) -> None:
        if isinstance(msg, m.Submit):
            self.submit(msg)
        elif isinstance(msg, m.Cancel):
            for rid in msg.rids:
                self.cancel((msg.worker, rid), RequestDropped("request cancelled; retry"))
        elif isinstance(msg, m.Audit):
            for rid in msg.rids:
                if (msg.worker, rid) not in self.requests:
                    self._reply((msg.worker, rid), None, RequestDropped(
                        "the engine holds no such request (its message was lost); retry"))
        elif isinstance(msg, m.StatsQuery):
            self.outbox.send(msg.worker, m.StatsReply(msg.qid, self.scheduler.stats()))
        elif isinstance(msg, m.Hello):
            with self._workers_lock:
                self.workers.add(msg.worker)
            self.outbox.send(msg.worker, self.status())
        elif isinstance(msg, m.WorkerGone):
            with self._workers_lock:
                self.workers.discard(msg.worker)
            for key in [k for k in list(self.requests) if k[0] == msg.worker]:
                self.cancel(key, RequestDropped("request cancelled: its API worker was "
                                                "reported gone; retry"))

    def submit(self, msg: m.Submit) -> None:
        key = (msg.worker, msg.rid)
        if key in self.requests:
            # the address is the request's own, which is answered in its turn
            self._bad.warning("dropped a Submit repeating request %d of worker %d", msg.rid,
                              msg.worker)
            return
        info = self.scheduler.info
        if info is None:
            self._reply(key, None, NotReady(f"engine is {self.scheduler.state}"))
            return
        ids, keys = submit_prompts(msg, info)
        req = Request(self, key, len(ids))
        done = [partial(req.done, i) for i in range(len(ids))]
        shared = msg.shared
        if shared and not msg.params.prompt_logprobs:  # those need every position computed
            qkeys = keys[0][:shared // info.page_size] if keys[0] is not None else None
            req.prompts = shared_query(ids, shared, msg.params, done, partial(req.done, -1),
                                       qkeys)
        else:
            req.prompts = [Prompt(p, msg.params, d, k) for p, d, k in zip(ids, done, keys)]
        self.requests[key] = req
        try:
            self.scheduler.submit(req.prompts)
        except (QueueFull, NotReady, KVPoolExhausted) as e:
            self.requests.pop(key, None)
            self._reply(key, None, e)

    def cancel(self, key: tuple[int, int], why: BaseException) -> bool:
        """Drop a request, if held, and answer it `why` (a client may still wait)."""
        req = self.requests.pop(key, None)
        if req is None:
            return False
        for p in req.prompts:
            self.scheduler.cancel(p)
        self._reply(key, None, why)
        return True

    def receive(self, sock: zmq.Socket, timeout_s: float) -> None:
        if not sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = m.to_engine(data)
            except Exception as e:  # noqa: BLE001 - a bad message must not stop the engine
                self._bad.warning("undecodable message (%d bytes) dropped: %s", len(data),
                                  str(e)[:200])
                continue
            self.handle(msg)

    def receive_work(self, inbox: zmq.Socket, timeout_s: float) -> None:
        with self._inbox_lock:
            self.receive(inbox, timeout_s)

    def serve(self, control: zmq.Socket, inbox: zmq.Socket, stop: threading.Event) -> None:
        """The main thread until `stop`; it reads work too while a launch holds the engine."""
        while not stop.is_set():
            self.receive(control, HELP_S)
            since = self.scheduler.launching_since
            if since and time.monotonic() - since > HELP_S and self._inbox_lock.acquire(False):
                try:
                    self.receive(inbox, 0.0)
                finally:
                    self._inbox_lock.release()


def bind(ctx: zmq.Context, addrs: m.Addresses, max_message_bytes: int = 64 << 20
         ) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
    """(inbox, control, router); ZeroMQ disconnects a peer whose message is over the cap."""
    pulls = []
    for addr, cap in ((addrs.inbox, max_message_bytes), (addrs.control, CONTROL_MESSAGE_BYTES)):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, cap)
        sock.bind(addr)
        pulls.append(sock)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(addrs.outbox)
    return pulls[0], pulls[1], router


def finish_hook(cfg: EngineConfig) -> FinishHook | None:
    if cfg.kv_transfer == "nixl":
        from service.kv_transfer.producer import NixlProducer
        return NixlProducer(cfg)
    return None


def run(engine_cfg: EngineConfig, server_cfg: ServerConfig, addrs: m.Addresses,
        alive: Connection) -> None:
    """The engine process's main: serve until SIGTERM or the engine fails. `alive` is only held."""
    setup_child(server_cfg.log_level, "service.engine")
    from service.engine.core import EngineCore
    from service.metrics import Metrics

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    metrics = Metrics(server_cfg.served_model_name)
    board = QueueBoard(addrs.board)
    ctx = zmq.Context()
    inbox, control, router = bind(ctx, addrs, m.max_submit_bytes(engine_cfg))
    scheduler = Scheduler(lambda: EngineCore(engine_cfg),
                          max_queue=engine_cfg.max_queue_requests,
                          max_batch_prompts=engine_cfg.max_batch_prompts,
                          prefix_cache=engine_cfg.prefix_cache, observer=metrics,
                          on_queue=board.write, poll=lambda t: server.receive_work(inbox, t),
                          finish_hook=finish_hook(engine_cfg))
    server = EngineServer(scheduler, Outbox(router))

    def on_loaded(exc: BaseException | None) -> None:
        if exc is not None:
            log.error("%s", exc)
            stop.set()
        else:
            freeze_heap()
            log.info("ready: %s, KV pool %d tokens", server_cfg.served_model_name,
                     scheduler.info.kv_capacity_tokens)
        server.broadcast_status()

    scheduler.start(on_loaded)
    server.serve(control, inbox, stop)
    scheduler.stop(STOP_WAIT_S)
    server.broadcast_status()
    exit_now(1 if scheduler.error else 0)
