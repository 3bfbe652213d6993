"""`python -m service` / `triton-prefill`: read settings once, bind, serve, drain on SIGTERM.

Start-up failures print one line and exit 2 (bad setting) or 1 (address, model path, load)."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from service.config import ConfigError, ServerConfig, Settings, load_settings, resolve

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("service")

SHUTDOWN_MARGIN_S = 5.0  # drain end -> exit: answer what is in flight, close, stop the engine
RESPONSE_FLUSH_S = 2.0  # of that margin: the last responses going out
GIL_SWITCH_INTERVAL_S = 0.001


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.signals: list[int] = []
        self.exit_code = 0

    @property
    def _state(self):  # noqa: ANN202 - the app's AppState
        return self.config.app.state.prefill

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: set flags only: this thread may hold the scheduler's lock now (on_tick acts). Not
        # recorded in uvicorn's _captured_signals, which would re-raise SIGTERM after shutdown.
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
        if len(self.signals) == 1 and not getattr(self, "_announced", False):
            self._announced = True
            log.info("signal %d: draining for up to %gs (%d requests in flight)",
                     self.signals[0], self.drain_timeout_s, state.active_requests)
        if state.active_requests == 0 and state.scheduler.in_flight == 0:
            self.should_exit = True
            return
        why = ("second signal" if len(self.signals) > 1 else
               "drain timeout" if time.monotonic() >= self.drain_deadline else None)
        if why is None:
            return
        from service.engine.prompt import NotReady

        n = state.scheduler.abort(NotReady("server is shutting down; retry on another replica"))
        log.warning("%s: answering %d requests in flight with 503", why, state.active_requests
                    or n)
        self.should_exit = True

    def fatal(self, message: str) -> None:
        log.error("%s", message)
        self.exit_code = 1
        self.should_exit = True


def uvicorn_config(app: FastAPI, server_cfg: ServerConfig, **overrides: Any) -> uvicorn.Config:
    from service.api.protocol import ConnectionLimits, GuardedProtocol

    limits = ConnectionLimits(server_cfg.max_header_bytes, server_cfg.header_timeout_s,
                              server_cfg.body_timeout_s, server_cfg.max_connections)
    state = app.state.prefill
    protocol = functools.partial(GuardedProtocol, limits=limits, count=state.metrics.count,
                                 refusal=state.refusal)
    kw = dict(http=protocol, ws="none", lifespan="on", log_level=server_cfg.log_level,
              access_log=server_cfg.access_log, timeout_graceful_shutdown=RESPONSE_FLUSH_S,
              log_config=None)
    return uvicorn.Config(app, **{**kw, **overrides})


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads (a taken port fails at once)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ConfigError(f"cannot listen on HOST={host!r} PORT={port}: "
                          f"{e.strerror or e}") from None
    return sock


def watchdog(server: DrainingServer) -> None:
    """Exit once the drain plus SHUTDOWN_MARGIN_S is over, however shutdown is going."""
    while True:
        time.sleep(0.25)
        deadline = server.drain_deadline
        if deadline is not None and time.monotonic() > deadline + SHUTDOWN_MARGIN_S:
            log.error("shutdown took more than DRAIN_TIMEOUT_S + %gs: exiting now",
                      SHUTDOWN_MARGIN_S)
            exit_now(1)


def exit_now(code: int) -> None:
    """Flush the logs and end the process without waiting for the engine thread."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(message: str, code: int) -> None:
    print(f"triton-prefill: {message}", file=sys.stderr)
    sys.exit(code)


def start(settings: Settings) -> tuple[DrainingServer, socket.socket]:
    try:
        sock = bind(settings.host, settings.port)
    except ConfigError as e:
        fail(str(e), 1)
    from service.model.errors import ModelLoadError
    from service.model.loader import check_model_path

    try:
        check_model_path(settings.model_path)
    except ModelLoadError as e:
        fail(f"MODEL_PATH: {e}", 1)
    import torch

    from service.host import cuda_requirement, describe_cpus, driver_version

    try:
        engine_cfg, server_cfg = resolve(settings, torch.cuda.is_available())
    except ConfigError as e:
        fail(str(e), 2)
    if settings.device == "auto" and engine_cfg.device == "cpu" and driver_version():
        log.warning("an NVIDIA driver is loaded but CUDA is not usable; serving on the CPU. %s",
                    cuda_requirement())
    log.info("torch CPU threads: %d (%s)", engine_cfg.cpu_threads,
             f"CPU_THREADS={settings.cpu_threads}" if settings.cpu_threads else describe_cpus())
    from service.api.app import create_app

    server: DrainingServer | None = None

    def on_fatal(message: str) -> None:
        assert server is not None
        server.fatal(message)

    app = create_app(engine_cfg=engine_cfg, server_cfg=server_cfg, on_fatal=on_fatal)
    server = DrainingServer(uvicorn_config(app, server_cfg), server_cfg.drain_timeout_s)
    log.info("serving %s on http://%s:%d: device=%s dtype=%s", server_cfg.served_model_name,
             server_cfg.host, server_cfg.port, engine_cfg.device, engine_cfg.dtype)
    return server, sock


def main() -> None:
    try:
        settings = load_settings()
    except ConfigError as e:
        fail(str(e), 2)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, sock = start(settings)
    # The engine thread retakes the GIL after every torch op: shorten each handover's wait
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    threading.Thread(target=watchdog, args=(server,), name="shutdown-watchdog",
                     daemon=True).start()
    server.run(sockets=[sock])
    exit_now(server.exit_code)


if __name__ == "__main__":
    main()
