"""A process of the service's HTTP side: an API worker (uvicorn on its PORT socket; SIGTERM
drains: 503 to new requests, DRAIN_TIMEOUT_S for those in flight, then a JSON 503; a second one
cuts it short) or the admin server (ADMIN_PORT: probes and scrapes, in a process of its own so
that no client request can hold them)."""

from __future__ import annotations

import functools
import logging
import math
import socket
import threading
import time
from multiprocessing.connection import Connection
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from service.config import EngineConfig, ServerConfig
from service.engine.interface import SHUTTING_DOWN, NotReady
from service.engine.messages import Addresses
from service.model.tokenizer import TextTokenizer
from service.process import exit_now, freeze_heap, setup_child

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("service.worker")

SHUTDOWN_MARGIN_S = 5.0  # drain end -> exit: answer what is in flight, close, stop the engine
RESPONSE_FLUSH_S = 2.0  # of that margin: the last responses going out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.signals: list[int] = []
        self._announced = False

    @property
    def _state(self):  # noqa: ANN202 - the app's AppState
        return self.config.app.state.prefill

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: flags for on_tick, not uvicorn's _captured_signals (they re-raise SIGTERM)
        self.signals.append(sig)
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self._state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._drain_step()
        return await super().on_tick(counter)

    def _drain_step(self) -> None:
        state = self._state
        if not self._announced:
            self._announced = True
            log.info("draining (%d requests in flight)", state.active_requests)
        if state.active_requests == 0:
            self.should_exit = True
            return
        why = ("second signal" if len(self.signals) > 1 else
               "drain timeout" if time.monotonic() >= self.drain_deadline else None)
        if why is None:
            return
        n = state.engine.abort(NotReady(SHUTTING_DOWN))
        log.warning("%s: answering %d requests in flight with 503", why, n)
        self.should_exit = True


class AdminServer(uvicorn.Server):
    """SIGTERM starts the drain (/ready: 503), probes still answered; the next one stops it."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.config.app.state.prefill
        if state.draining:
            self.should_exit = True
        else:
            state.begin_drain()


def uvicorn_config(app: FastAPI, server_cfg: ServerConfig, *, workers: int = 1,
                   admin: bool = False, **overrides: Any) -> uvicorn.Config:
    """The API workers' server on PORT, or with `admin` the admin server's on ADMIN_PORT."""
    from service.api.admin import ADMIN_IDLE_S, admin_protocol
    from service.api.connection import ConnectionLimits, GuardedProtocol

    state = app.state.prefill
    kw: dict[str, Any] = dict(
        ws="none", lifespan="on", log_level=server_cfg.log_level,
        access_log=server_cfg.access_log, timeout_graceful_shutdown=RESPONSE_FLUSH_S,
        log_config=None)
    if admin:
        kw.update(http=admin_protocol(server_cfg.max_header_bytes, state.metrics.count),
                  timeout_keep_alive=ADMIN_IDLE_S)
    else:
        limits = ConnectionLimits(server_cfg.max_header_bytes, server_cfg.header_timeout_s,
                                  server_cfg.body_timeout_s,
                                  math.ceil(server_cfg.max_connections / workers))
        kw["http"] = functools.partial(GuardedProtocol, limits=limits,
                                       count=state.metrics.count, refusal=state.refusal)
    return uvicorn.Config(app, **{**kw, **overrides})


def watchdog(server: DrainingServer) -> None:
    """Exit once the drain plus SHUTDOWN_MARGIN_S is over, however shutdown is going."""
    while True:
        time.sleep(0.25)
        deadline = server.drain_deadline
        if deadline is not None and time.monotonic() > deadline + SHUTDOWN_MARGIN_S:
            log.error("shutdown took more than DRAIN_TIMEOUT_S + %gs: exiting now",
                      SHUTDOWN_MARGIN_S)
            exit_now(1)


def run(worker: int, slot: int, engine_cfg: EngineConfig, server_cfg: ServerConfig,
        addrs: Addresses, sockets: list[socket.socket], alive: Connection,
        tokenizer: TextTokenizer, admin: bool = False) -> None:
    """API worker `worker` (new per process), or the admin server; `slot` names its metric files
    and passes from a dead process to its replacement."""
    setup_child(server_cfg.log_level, "service.worker")
    from service.api.app import create_app
    from service.api.engine_client import EngineClient
    from service.metrics import use_slot

    use_slot(slot)  # before create_app makes the metrics

    engine = EngineClient(addrs, worker, max_queue=engine_cfg.max_queue_requests, alive=alive,
                          key_page_size=engine_cfg.page_size if engine_cfg.prefix_cache else 0,
                          request_timeout_s=server_cfg.request_timeout_s)
    app = create_app(engine_cfg, server_cfg, engine, tokenizer)
    config = uvicorn_config(app, server_cfg, workers=server_cfg.api_workers, admin=admin)
    if admin:
        server: uvicorn.Server = AdminServer(config)
    else:
        server = DrainingServer(config, server_cfg.drain_timeout_s)
        threading.Thread(target=watchdog, args=(server,), name="shutdown-watchdog",
                         daemon=True).start()
    freeze_heap()
    server.run(sockets=sockets)
    exit_now(0 if server.started else 3)
