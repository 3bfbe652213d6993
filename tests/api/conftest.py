"""Fixtures for the API tests: one real SmolLM2 engine per session, cheap apps around it.

Apps run on a background event-loop thread with their lifespan entered, and are driven through
`httpx.AsyncClient(transport=ASGITransport(app))`; tests call the sync helpers (`get`, `post`,
`run`). Every app's engine is a `TestEngine` proxy of the shared core, which can slow down or
fail forwards on demand, so building an app costs no model load.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
import zmq

from service.api.app import ROUTERS, create_app
from service.api.engine_client import EngineClient
from service.api.worker import uvicorn_config
from service.config import load_settings, resolve
from service.engine import server
from service.engine.board import QueueBoard
from service.engine.messages import Addresses
from service.engine.scheduler import Scheduler
from service.metrics import Metrics
from service.model.files import model_tokenizer

FAULT_TOKEN = 31337  # a prompt containing this id makes TestEngine.forward raise
_CORE_LOCK = threading.Lock()  # every TestEngine shares the one real core: one forward at a time


class TestEngine:
    """Proxy of the real EngineCore with fault/slowness injection and a forward log."""

    __test__ = False

    def __init__(self, core: Any, max_batch_tokens: int | None = None):
        self._core = core
        self._max_batch_tokens = max_batch_tokens
        self.delay_s = 0.0
        self._gpu_free_at = 0.0
        self.fault_token: int | None = FAULT_TOKEN
        self.forwards: list[list[tuple[int, ...]]] = []  # token ids of every chunk, per forward
        self._lock = _CORE_LOCK

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    @property
    def max_batch_tokens(self) -> int:
        return self._max_batch_tokens or self._core.max_batch_tokens

    @property
    def synchronous(self) -> bool:
        """With `delay_s` it plays a GPU: a launch returns before its forward is over."""
        return self._core.synchronous and not self.delay_s

    def launch(self, chunks: list) -> Any:
        """`delay_s` acts as GPU time: forwards queue behind each other and `wait` waits."""
        self.forwards.append([c.token_ids for c in chunks])
        if self.fault_token is not None and any(self.fault_token in c.token_ids for c in chunks):
            raise RuntimeError("injected fault")
        with self._lock:
            launched = self._core.launch(chunks)
        if not self.delay_s:
            return launched
        self._gpu_free_at = end = max(time.monotonic(), self._gpu_free_at) + self.delay_s

        def wait() -> Any:
            time.sleep(max(end - time.monotonic(), 0.0))
            return launched.wait()
        return SimpleNamespace(wait=wait, ready=lambda: time.monotonic() >= end)

    def forward(self, chunks: list) -> Any:
        return self.launch(chunks).wait()

    def close(self) -> None:
        pass


class EngineThread:
    """The engine process's server on threads of this process, over real ZeroMQ sockets."""

    def __init__(self, make_scheduler: Callable[[Callable[[int, int], None],
                                                 Callable[[float], None]], Scheduler],
                 max_message_bytes: int = 64 << 20):
        self.dir = tempfile.mkdtemp(prefix="tp-")  # short: IPC paths are limited to ~100 bytes
        self.addrs = Addresses.in_dir(self.dir)
        self.board = QueueBoard(self.addrs.board, create=True)
        self.silenced = False
        self.ctx = zmq.Context()
        inbox, control, router = server.bind(self.ctx, self.addrs, max_message_bytes)
        self.scheduler = scheduler = make_scheduler(self.board.write,
                                                    lambda t: self._poll(inbox, t))
        self.server = server.EngineServer(scheduler, _Outbox(router, self))
        self.stop = threading.Event()
        scheduler.start(lambda exc: self.server.broadcast_status())
        self.thread = threading.Thread(target=self.server.serve,
                                       args=(control, inbox, self.stop), daemon=True)
        self.thread.start()

    def _poll(self, inbox: zmq.Socket, timeout_s: float) -> None:
        if self.silenced:
            time.sleep(timeout_s)
        else:
            self.server.receive_work(inbox, timeout_s)

    def silence(self) -> None:
        """From now on the engine reads nothing and its replies are lost."""
        self.silenced = True
        self.stop.set()
        self.thread.join(10)

    def close(self) -> None:
        self.silence()
        self.scheduler.stop(10.0)  # a forward under way finishes and frees its pages
        self.ctx.destroy(0)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Outbox(server.Outbox):
    def __init__(self, sock: zmq.Socket, owner: EngineThread):
        super().__init__(sock)
        self._owner = owner

    def send(self, worker: int, msg: Any) -> None:
        if not self._owner.silenced:
            super().send(worker, msg)


class LiveApp:
    """An app with its lifespan running on a private event-loop thread, its engine on another."""

    def __init__(self, app: Any, engine: EngineThread, alive: Any):
        self.app, self.engine_thread, self._alive = app, engine, alive
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(self.app),
                                        base_url="http://test", timeout=120)

    async def _stop(self) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)

    @property
    def state(self) -> Any:
        return self.app.state.prefill

    @property
    def scheduler(self) -> Scheduler:
        return self.engine_thread.scheduler

    @property
    def engine(self) -> TestEngine:
        return self.scheduler.engine

    def kill_engine(self) -> None:
        """What the workers see when the engine process dies: its end of the alive pipe closes,
        and it answers nothing more."""
        self.engine_thread.silence()
        self._alive.close()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Any) -> Any:
        """Start `coro` on the app's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.run(self.client.get(path, **kw))

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.run(self.client.post(path, **kw))

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(lambda: self.get("/ready").status_code == 200, timeout, "/ready")

    def close(self) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.engine_thread.close()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def metric(text: str, sample: str, **labels: str) -> float:
    """The value of the `sample` series (e.g. "prefill_requests_total") whose labels include
    `labels`, in /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"no sample {sample}{labels} in /metrics")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configs(**env: Any) -> tuple[Any, Any]:
    return resolve(load_settings({k.upper(): str(v) for k, v in env.items()}), False)


@pytest.fixture(scope="session")
def core() -> Any:
    """The real engine on the default model (embedded SmolLM2-135M GGUF), loaded once."""
    from service.engine.core import EngineCore

    eng = EngineCore(configs()[0])
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return model_tokenizer(None)


def start_app(engine_factory: Callable[[Any], Any], tokenizer: Any, routers: Any = ROUTERS,
              **env: Any) -> LiveApp:
    """An app with env overrides whose engine is `engine_factory(EngineConfig)`, started (not
    yet ready): the app in this process, its engine's server loop on a thread, ZeroMQ between
    them. The caller closes it."""
    eng_cfg, srv_cfg = configs(**env)
    metrics = Metrics(srv_cfg.served_model_name)
    engine = EngineThread(lambda on_queue, poll: Scheduler(
        lambda: engine_factory(eng_cfg), max_queue=eng_cfg.max_queue_requests,
        max_batch_prompts=eng_cfg.max_batch_prompts, prefix_cache=eng_cfg.prefix_cache,
        observer=metrics, on_queue=on_queue, poll=poll,
        finish_hook=server.finish_hook(eng_cfg)))
    alive_r, alive_w = multiprocessing.Pipe(duplex=False)
    client = EngineClient(engine.addrs, 0, max_queue=eng_cfg.max_queue_requests,
                          alive=alive_r,
                          key_page_size=eng_cfg.page_size if eng_cfg.prefix_cache else 0,
                          request_timeout_s=srv_cfg.request_timeout_s)
    app = create_app(eng_cfg, srv_cfg, client, tokenizer, metrics=metrics, routers=routers)
    return LiveApp(app, engine, alive_w)


@pytest.fixture
def make_app(core: Any, tokenizer: Any) -> Iterator[Callable[..., LiveApp]]:
    """make_app(env overrides..., engine_factory=None, max_batch_tokens=None, routers=ROUTERS)
    -> ready LiveApp (start_app's) on the session core, or on `engine_factory(EngineConfig)`."""
    apps: list[LiveApp] = []

    def make(engine_factory: Callable | None = None, max_batch_tokens: int | None = None,
             wait: bool = True, routers: Any = ROUTERS, **env: Any) -> LiveApp:
        factory = engine_factory or (lambda cfg: TestEngine(core, max_batch_tokens))
        live = start_app(factory, tokenizer, routers, **env)
        apps.append(live)
        if wait:
            live.wait_ready()
        return live

    yield make
    for live in apps:
        live.close()
    assert core.pool.used_tokens == 0, "a test leaked KV pages"


@pytest.fixture
def api(make_app: Callable[..., LiveApp]) -> LiveApp:
    """A ready app with default settings."""
    return make_app()


@pytest.fixture
def served(make_app: Callable[..., LiveApp]) -> Iterator[Callable[..., str]]:
    """served(**env) -> base URL of an app under a real uvicorn (configured as the CLI does)
    on a free loopback port."""
    servers: list[tuple[uvicorn.Server, Any]] = []

    def serve(**env: Any) -> str:
        live = make_app(**env)
        port = free_port()
        uv = uvicorn.Server(uvicorn_config(live.app, live.state.server_cfg,
                                           host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
        # on the app's own loop, where its engine client lives
        servers.append((uv, live.submit(uv.serve())))
        wait_for(lambda: uv.started, 10, "uvicorn start")
        serve.live = live  # the latest app, for tests that reach into its engine
        return f"http://127.0.0.1:{port}"

    yield serve
    for uv, done in servers:
        uv.should_exit = True
        done.result(10)


@pytest.fixture
def service(tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """service(**env) -> a started `python -m service` (tests.api.services.Service), killed at
    the end."""
    from tests.api.services import Service

    started: list[Service] = []

    def start(wait: bool = True, **env: str) -> Service:
        started.append(Service(tmp_path, wait, **env))
        return started[-1]

    yield start
    for s in started:
        s.close()
