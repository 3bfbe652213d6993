"""`python -m service`: settings, port and model checked once (a bad one: one line, exit 2 or 1),
then the engine process, the API workers (PORT) and the admin server (ADMIN_PORT); a dead worker
or admin server is replaced, a dead engine stops the service (exit 1); SIGTERM drains and stops
the workers while the admin server answers the probes (/ready 503), then stops the admin server,
then the engine."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from service.api import worker
from service.api.worker import SHUTDOWN_MARGIN_S
from service.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    Settings,
    load_settings,
    resolve,
)
from service.host import api_workers
from service.model.tokenizer import TextTokenizer
from service.process import setup_logging

log = logging.getLogger("service")

TICK_S = 0.2
WORKER_STOP_S = 5.0  # after the engine died: the workers' last 503s
ADMIN_STOP_S = 2.0  # the admin server's shutdown: its open connections closed
RESTARTS = (5, 60.0)  # more worker deaths than this within that many seconds: give up
# Linux balances an SO_REUSEPORT group's connections over its listeners; other kernels may not
REUSE_PORT = sys.platform.startswith("linux")


def fail(message: str, code: int) -> None:
    print(f"triton-prefill: {message}", file=sys.stderr)
    sys.exit(code)


def bind(host: str, port: int, name: str = "PORT", group: int = 0) -> list[socket.socket]:
    """Listening sockets, bound before anything loads (a taken port fails at once); `name` is
    the setting that chose the port, for the error. `group` = 0: one socket; else that many in
    one SO_REUSEPORT group, where the kernel spreads new connections over the members that
    listen (by a hash of the connection's addresses). A plain bind goes first: it fails while
    anyone listens on the port, even with SO_REUSEPORT as the same user (another copy of this
    service), which the group's binds would join."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

        def bound(reuse_port: bool) -> socket.socket:
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
            return sock

        first = bound(reuse_port=False)
        if not group:
            return [first]
        with first:  # NOTE: bound, never listening: the group's binds pass beside it
            return [bound(reuse_port=True) for _ in range(group)]
    except OSError as e:
        raise ConfigError(f"cannot listen on HOST={host!r} {name}={port}: "
                          f"{e.strerror or e}") from None


def configure(settings: Settings) -> tuple[EngineConfig, ServerConfig,
                                           list[list[socket.socket]], TextTokenizer]:
    """Everything that can fail in one line, before any process starts. The listening sockets
    of each slot: per worker slot a PORT socket of its own (on Linux; elsewhere one for all),
    then, unless ADMIN_PORT is 0, the admin server's slot with ADMIN_PORT's."""
    workers = api_workers(settings.api_workers)
    try:
        port = bind(settings.host, settings.port, group=workers if REUSE_PORT else 0)
        admin = (bind(settings.host, settings.admin_port, "ADMIN_PORT") if settings.admin_port
                 else [])
    except ConfigError as e:
        fail(str(e), 1)
    sockets = [[port[slot % len(port)]] for slot in range(workers)] + ([admin] if admin else [])
    from service.model.errors import ModelLoadError
    from service.model.files import check_model_path, model_tokenizer

    try:
        check_model_path(settings.model_path)
        tokenizer = model_tokenizer(settings.model_path)  # the workers get a copy
    except ModelLoadError as e:
        fail(f"MODEL_PATH: {e}", 1)
    import torch  # only to see whether CUDA is usable: no context is created here

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
    return engine_cfg, server_cfg, sockets, tokenizer


class Supervisor:
    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                 sockets: list[list[socket.socket]], tokenizer: TextTokenizer):
        from service.engine.board import QueueBoard
        from service.engine.messages import Addresses

        self.engine_cfg, self.server_cfg, self.sockets = engine_cfg, server_cfg, sockets
        self.tokenizer = tokenizer
        self.dir = Path(tempfile.mkdtemp(prefix="triton-prefill-"))
        # NOTE: set before any child imports prometheus_client: counters go to per-process files
        (self.dir / "metrics").mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.dir / "metrics")
        self.addrs = Addresses.in_dir(self.dir)
        QueueBoard(self.addrs.board, create=True).close()
        self.ctx = mp.get_context("spawn")
        self.workers: dict[int, BaseProcess] = {}  # the admin server's process among them
        self.slots: dict[int, int] = {}  # worker id -> its metrics slot (metrics.use_slot)
        # the slot after the API workers' (None: ADMIN_PORT=0), and its process's worker id
        self.admin_slot = server_cfg.api_workers if server_cfg.admin_port else None
        self.admin: int | None = None
        self.next_worker = 0
        self.deaths: deque[float] = deque()
        self.signals: list[int] = []
        self.engine: BaseProcess | None = None
        self.alive: Connection | None = None
        self._push = None

    def start(self) -> None:
        from service.engine import server

        self.alive, alive_w = self.ctx.Pipe(duplex=False)
        self.engine = self.ctx.Process(target=server.run, name="engine", args=(
            self.engine_cfg, self.server_cfg, self.addrs, alive_w))
        self.engine.start()
        log.info("started the engine (pid %d)", self.engine.pid)
        alive_w.close()  # the engine holds the only write end: its death is the readers' EOF
        for slot in range(len(self.sockets)):
            self.spawn_worker(slot)
        log.info("serving %s on http://%s:%d: device=%s dtype=%s, %d API workers",
                 self.server_cfg.served_model_name, self.server_cfg.host, self.server_cfg.port,
                 self.engine_cfg.device, self.engine_cfg.dtype, self.server_cfg.api_workers)
        if self.server_cfg.admin_port:
            log.info("probes and scrapes on http://%s:%d (ADMIN_PORT)", self.server_cfg.host,
                     self.server_cfg.admin_port)

    def spawn_worker(self, slot: int) -> None:
        """A new worker id for every process (a replacement must not get the replies meant
        for the dead one); the metrics slot and the slot's sockets are handed on. The supervisor
        keeps them open: the connections the kernel queued on a dead worker's PORT socket, and
        those it hashes there until the replacement serves it, wait for the replacement."""
        i, self.next_worker = self.next_worker, self.next_worker + 1
        admin = slot == self.admin_slot
        p = self.ctx.Process(target=worker.run, name=f"{'admin' if admin else 'worker'}-{i}",
                             args=(i, slot, self.engine_cfg, self.server_cfg, self.addrs,
                                   self.sockets[slot], self.alive, self.tokenizer, admin))
        p.start()
        log.info("started %s %d (pid %d)", "the admin server" if admin else "API worker", i,
                 p.pid)
        self.workers[i], self.slots[i] = p, slot
        if admin:
            self.admin = i

    def worker_gone(self, i: int) -> int | None:
        """Cancel the dead worker's requests in the engine; restart it, or give up (exit code)."""
        import zmq

        from service.engine import messages as m

        p, slot = self.workers.pop(i), self.slots.pop(i)
        p.join(1.0)  # reaped: its exit code
        log.warning("%s %d (pid %d) exited with %s: restarting it",
                    "the admin server" if i == self.admin else "API worker", i, p.pid,
                    p.exitcode)
        if self._push is None:
            self._push = zmq.Context.instance().socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self.addrs.inbox)
        self._push.send(m.encode(m.WorkerGone(i)), zmq.NOBLOCK)
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > RESTARTS[1]:
            self.deaths.popleft()
        if len(self.deaths) > RESTARTS[0]:
            log.error("API workers died %d times within %gs: stopping", len(self.deaths),
                      RESTARTS[1])
            return self.stop_all(1)
        self.spawn_worker(slot)  # it has exited: its files are free
        return None

    def release_port(self) -> None:
        """No worker is replaced in a drain: each PORT socket lives on only in its worker, and
        leaves the group when that worker has drained and exits, so new connections go to the
        workers still draining (and get their 503s), not to a socket no one serves."""
        for sockets in self.sockets[:self.server_cfg.api_workers]:
            sockets[0].close()

    def on_signal(self, sig: int, _frame: object) -> None:
        self.signals.append(sig)

    def run(self) -> int:
        assert self.engine is not None
        deadline: float | None = None
        handled = 0
        while True:
            sentinels = {p.sentinel: i for i, p in self.workers.items()}
            ready = wait([self.engine.sentinel, *sentinels], TICK_S)
            if self.engine.sentinel in ready:
                return self.engine_gone(deadline is not None)
            if deadline is None and self.signals:
                deadline = time.monotonic() + self.server_cfg.drain_timeout_s + SHUTDOWN_MARGIN_S
                log.info("signal %d: draining for up to %gs", self.signals[0],
                         self.server_cfg.drain_timeout_s)
                self.release_port()
                self.signal_workers(admin=True)  # the admin server: /ready 503 from now
            if deadline is not None:
                if len(self.signals) > handled:
                    handled = len(self.signals)
                    self.signal_workers()  # the first: drain; a second one: stop now
                for s in ready:
                    self.workers.pop(sentinels[s])
                if set(self.workers) <= {self.admin}:
                    self.stop_admin()
                    return self.stop_engine(deadline)
                if time.monotonic() > deadline:
                    log.error("shutdown took more than DRAIN_TIMEOUT_S + %gs: exiting now",
                              SHUTDOWN_MARGIN_S)
                    return self.stop_all(1)
                continue
            for s in ready:
                if (code := self.worker_gone(sentinels[s])) is not None:
                    return code

    def signal_workers(self, admin: bool = False) -> None:
        """SIGTERM to the API workers, or to the admin server only."""
        for i, p in self.workers.items():
            if (i == self.admin) == admin and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def stop_admin(self) -> None:
        """Its second SIGTERM (the first began its drain): it stops; killed if it does not."""
        p = self.workers.pop(self.admin, None) if self.admin is not None else None
        if p is None:
            return
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
        p.join(ADMIN_STOP_S)
        if p.exitcode is None:
            log.error("the admin server did not stop in time: killing it")
            p.kill()

    def stop_engine(self, deadline: float) -> int:
        assert self.engine is not None
        self.engine.terminate()
        self.engine.join(max(deadline - time.monotonic(), 0.1))
        if self.engine.exitcode is None:
            log.error("the engine did not stop in time: killing it")
            return self.stop_all(1)
        return 0 if self.engine.exitcode == 0 else 1

    def engine_gone(self, stopping: bool) -> int:
        assert self.engine is not None
        self.engine.join(1.0)
        code = self.engine.exitcode
        if code is not None and code < 0:
            log.error("the engine process was killed by signal %d: stopping", -code)
        elif not stopping:
            # NOTE: an engine that failed has logged why (the one ERROR line of a bad start)
            log.info("the engine process exited with %s: stopping", code)
        self.signal_workers()
        self.signal_workers(admin=True)  # it answers 503 until the workers are gone
        end = time.monotonic() + WORKER_STOP_S
        for i, p in self.workers.items():
            if i != self.admin:
                p.join(max(end - time.monotonic(), 0.0))
        self.stop_all(1)
        return 1

    def stop_all(self, code: int) -> int:
        for p in [*self.workers.values(), self.engine]:
            if p is not None and p.is_alive():
                p.kill()
        return code

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    try:
        settings = load_settings()
    except ConfigError as e:
        fail(str(e), 2)
    setup_logging(settings.log_level)
    sup = Supervisor(*configure(settings))
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    try:
        sup.start()
        code = sup.run()
    finally:
        sup.cleanup()
    sys.exit(code)
