"""The probes of `python -m service` come from the admin server, a process of its own: they are
answered while the API worker is stopped, through a flood of idle and partial connections to
ADMIN_PORT, and through a drain; a dead admin server is replaced."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.api.conftest import wait_for
from tests.api.services import Service
from tests.api.test_connections import connect

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> Service:
    s = Service(tmp_path_factory.mktemp("probes"), API_WORKERS="1", MAX_PREFILL_TOKENS="16",
                ACCESS_LOG="false", DRAIN_TIMEOUT_S="120")
    yield s
    s.close()


def probe(svc: Service, path: str, timeout: float = 5.0) -> int | str:
    try:
        return httpx.get(svc.admin_url + path, timeout=timeout).status_code
    except httpx.TransportError as e:
        return type(e).__name__


def test_head_probes_on_the_admin_port(svc) -> None:
    for path in ("/health", "/ready"):
        r = httpx.head(svc.admin_url + path, timeout=5)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


def test_probes_need_nothing_of_a_stopped_api_worker(svc) -> None:
    """SIGSTOP holds the worker's loop and GIL as a long request at worst would."""
    (worker,) = svc.pids("API worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        got = [(path, probe(svc, path, timeout=1.0))
               for _ in range(5) for path in ("/health", "/ready")]
        assert probe(svc, "/metrics", timeout=3.0) == 200
    finally:
        os.kill(worker, signal.SIGCONT)
    assert all(status == 200 for _, status in got), got


class Flood:
    """`idle` connections that send nothing and `partial` ones inside a request head, held to
    ADMIN_PORT; one the server closes or answers is opened again, every `every_s`."""

    def __init__(self, url: str, idle: int, partial: int, every_s: float = 0.5):
        self.url, self.every_s = url, every_s
        self.socks = [self.open(i < partial) for i in range(idle + partial)]
        self.partial = partial
        self.reopened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.hold, daemon=True)
        self.thread.start()

    def open(self, partial: bool) -> socket.socket:
        s = connect(self.url)
        if partial:
            s.sendall(PARTIAL_HEAD)
        return s

    def hold(self) -> None:
        while not self.stop.wait(self.every_s):
            ready = set(select.select(self.socks, [], [], 0)[0])
            for i, s in enumerate(self.socks):
                if s in ready:
                    s.close()
                    self.socks[i] = self.open(i < self.partial)
                    self.reopened += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()


@pytest.mark.slow
def test_probes_are_answered_through_200_idle_and_partial_connections(svc) -> None:
    """150 idle connections and 50 partial heads held to ADMIN_PORT for 30 s; a probe every
    100 ms, each on a new connection as a kubelet's, is answered 200 every time."""
    flood = Flood(svc.admin_url, idle=150, partial=50)
    statuses: Counter = Counter()
    try:
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            for path in ("/health", "/ready"):
                statuses[(path, probe(svc, path))] += 1
            time.sleep(0.1)
    finally:
        flood.close()
    assert set(statuses) == {("/health", 200), ("/ready", 200)}, statuses
    assert sum(statuses.values()) >= 100 and flood.reopened > 200, (statuses, flood.reopened)


def test_a_killed_admin_server_is_replaced(svc) -> None:
    (admin,) = svc.pids("the admin server")
    os.kill(admin, signal.SIGKILL)
    wait_for(lambda: svc.pids("the admin server") not in ([], [admin]), 30, "a new admin server")
    wait_for(lambda: probe(svc, "/ready") == 200, 60, "the new admin server's /ready")
    assert "the admin server" in svc.tail(10**7).split("restarting it")[0].rsplit("\n", 1)[-1]


def test_the_admin_server_answers_through_the_drain(svc) -> None:
    """SIGTERM: /ready 503 "draining" and /health 200 from ADMIN_PORT while the worker drains
    a request; then everything exits 0. Runs last: it stops the module's service."""
    slow = svc.post_in_background({"prompt": "The quick brown fox jumps over the lazy dog. " * 8})
    svc.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: probe(svc, "/ready") == 503, 5, "/ready to turn 503")
    r = httpx.get(svc.admin_url + "/ready", timeout=5)
    assert r.json()["reason"] == "draining"
    assert probe(svc, "/health") == 200
    slow["thread"].join(120)
    assert slow["r"].status_code == 200, slow["r"].text
    assert svc.proc.wait(timeout=30) == 0, svc.tail()
