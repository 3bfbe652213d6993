"""ADMIN_PORT: probes and scrapes keep being answered while clients hold every connection
MAX_CONNECTIONS allows; past its allowance the admin server sheds its oldest idle connections
instead of refusing new ones; the admin port serves only GET /health, /ready and /metrics."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from service.api.admin import ADMIN_IDLE_S, NOT_SERVED
from service.api.worker import uvicorn_config
from tests.api.conftest import LiveApp, free_port, metric, wait_for
from tests.api.services import REPO, service_env
from tests.api.test_connections import connect, exchange, parse, read_all, read_response

# A request whose body never completes: the connection stays open until BODY_TIMEOUT_S
PARTIAL_BODY = (b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\": \"Hi")
GET_CLOSE = b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
GET_KEEP = b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n"
NOT_FOUND = {"error": {"message": NOT_SERVED, "type": "invalid_request_error", "param": None,
                       "code": 404}}


def refused(s: socket.socket) -> None:
    status, _, body = parse(read_all(s))
    assert status == 503 and body["error"]["code"] == "too_many_connections", body


def fill(url: str, cap: int, settle_s: float = 1.0, rounds: int = 20,
         exact: bool = True) -> list[socket.socket]:
    """Open partial-body connections to `url`, always a few past what is held, until `cap` are
    held open and the server refused every other one with a 503 (asserted). Not `exact`: more
    than `cap` may stay unanswered once a round's new connections were all refused (with a
    socket per worker, one can wait in a kernel accept queue while its worker starts)."""
    held: list[socket.socket] = []
    for _ in range(rounds):
        new = [connect(url) for _ in range(max(2, cap - len(held) + 2))]
        for s in new:
            s.sendall(PARTIAL_BODY)
        held += new
        answered = answered_within(held, settle_s)
        for s in answered:
            refused(s)
            held.remove(s)
            s.close()
        if len(held) == cap or (not exact and len(held) > cap
                                and all(s in answered for s in new)):
            return held
    raise AssertionError(f"{len(held)} connections held after {rounds} rounds, not {cap}")


def answered_within(socks: list[socket.socket], seconds: float) -> list[socket.socket]:
    """Those of `socks` the server answers (or closes) within `seconds`: all of the wait, not
    only until the first answer (on a loaded host the refusals come one by one)."""
    deadline, pending, answered = time.monotonic() + seconds, list(socks), []
    while pending and (left := deadline - time.monotonic()) > 0:
        ready = select.select(pending, [], [], left)[0]
        answered += ready
        pending = [s for s in pending if s not in ready]
    return answered


@pytest.fixture
def listening() -> Callable[[], socket.socket]:
    """listening() -> a socket bound to a free loopback port (uvicorn listens and closes it)."""
    def make() -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        return s
    return make


@pytest.fixture
def served_two(make_app: Callable[..., LiveApp],
               listening: Callable[[], socket.socket]) -> Iterator[Callable[..., tuple[str, str]]]:
    """served_two(**env) -> (PORT's URL, ADMIN_PORT's URL): the app under two real uvicorn
    servers on loopback sockets, configured as an API worker's and the admin server's are."""
    servers: list[tuple[uvicorn.Server, Any]] = []

    def serve(**env: Any) -> tuple[str, str]:
        main, admin = listening(), listening()
        live = make_app(admin_port=admin.getsockname()[1], **env)
        for sock, is_admin in ((main, False), (admin, True)):
            uv = uvicorn.Server(uvicorn_config(live.app, live.state.server_cfg, admin=is_admin,
                                               lifespan="off", log_level="warning"))
            servers.append((uv, live.submit(uv.serve(sockets=[sock]))))
            wait_for(lambda uv=uv: uv.started, 10, "uvicorn start")
        return tuple(f"http://127.0.0.1:{s.getsockname()[1]}" for s in (main, admin))

    yield serve
    for uv, done in servers:
        uv.should_exit = True
        done.result(10)


def test_past_its_allowance_the_admin_port_sheds_the_oldest_idle_connection(
        served_two, monkeypatch) -> None:
    monkeypatch.setattr("service.api.admin.ADMIN_MAX_CONNECTIONS", 4)
    monkeypatch.setattr("service.api.admin.ADMIN_IDLE_S", 30.0)  # no closes but the shedding
    url, admin = served_two(max_connections=3)
    opened: list[socket.socket] = []
    try:
        opened += fill(url, 3)
        refused(s := connect(url))  # PORT is full, and refuses
        s.close()
        # ADMIN_PORT takes its 4 connections whatever PORT holds, and answers on each
        opened += (probes := [connect(admin) for _ in range(4)])
        for s in probes:
            s.sendall(GET_KEEP % b"/health")
            status, _, body = parse(read_response(s))
            assert status == 200 and body["status"] == "ok", body
        time.sleep(0.2)  # past ADMIN_GRACE_S: each of the 4 may be shed
        # a fifth is served, and the oldest idle one is closed for it
        assert exchange(admin, GET_CLOSE % b"/ready")[0] == 200
        assert answered_within(probes, 1.0) == probes[:1] and read_all(probes[0]) == b""
        for s in probes[1:]:  # the others stay open and keep answering
            s.sendall(GET_KEEP % b"/health")
            assert parse(read_response(s))[0] == 200
    finally:
        for s in opened:
            s.close()


def test_idle_admin_connections_close_fast(served_two) -> None:
    """An idle keep-alive connection and a partial head each close within ADMIN_IDLE_S."""
    _, admin = served_two()
    with connect(admin) as idle, connect(admin) as partial:
        idle.sendall(GET_KEEP % b"/health")
        assert parse(read_response(idle))[0] == 200
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert len(answered_within([idle, partial], ADMIN_IDLE_S + 2.0)) == 2
        assert time.monotonic() - t0 < ADMIN_IDLE_S + 2.0
        assert read_all(idle) == b""
        assert parse(read_all(partial))[0] == 408


def test_head_probes_answer_without_a_body(served_two) -> None:
    _, admin = served_two()
    for path in ("/health", "/ready", "/metrics"):
        r = httpx.head(admin + path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


def test_the_admin_port_serves_probes_and_scrapes_only(served_two) -> None:
    url, admin = served_two()
    assert httpx.get(admin + "/health").json()["status"] == "ok"
    assert httpx.get(admin + "/ready").json() == {"status": "ready"}
    assert metric(httpx.get(admin + "/metrics").text, "prefill_ready") == 1
    for r in (httpx.post(admin + "/v1/prefill", json={"prompt": "Hi"}),
              httpx.get(admin + "/info"), httpx.get(admin + "/v1/models"),
              httpx.post(admin + "/health")):
        assert r.status_code == 404 and r.json() == NOT_FOUND, r.text
        assert r.headers["content-type"] == "application/json"
    assert httpx.post(url + "/v1/prefill", json={"prompt": "Hi"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # PORT keeps serving the probes too


def test_probes_are_answered_through_a_connection_flood(service) -> None:
    """Clients hold every connection MAX_CONNECTIONS allows (8 over 2 workers) with bodies that
    never finish, and more keep coming; a burst of probes on ADMIN_PORT is answered in full."""
    svc = service(MAX_CONNECTIONS="8", API_WORKERS="2", BODY_TIMEOUT_S="600",
                  ACCESS_LOG="false")
    held = fill(svc.url, 8, settle_s=3.0, exact=False)  # refusals come late on a loaded host
    try:
        for _ in range(3):  # every new client connection is refused: the cap is real
            status, _, body = exchange(svc.url, GET_CLOSE % b"/health")
            assert status == 503 and body["error"]["code"] == "too_many_connections", body
        failed = []
        for _ in range(30):
            for path in ("/health", "/ready", "/metrics"):
                try:
                    r = httpx.get(svc.admin_url + path, timeout=5)
                except httpx.TransportError as e:
                    failed.append(f"{path}: {e!r}")
                    continue
                ok = r.status_code == 200 and (
                    r.json()["status"] == "ok" if path == "/health" else
                    r.json() == {"status": "ready"} if path == "/ready" else
                    metric(r.text, "prefill_ready") == 1)
                if not ok:
                    failed.append(f"{path}: {r.status_code} {r.text[:200]}")
        assert not failed, f"{len(failed)} of 90 probes failed: {failed[:5]}"
        r = httpx.post(svc.admin_url + "/v1/prefill", json={"prompt": "Hi"}, timeout=5)
        assert r.status_code == 404 and r.json() == NOT_FOUND, r.text
        still = len(held) - len(select.select(held, [], [], 0)[0])
        assert still >= 8, f"the flood ended before the probes did: {still} connections held"
    finally:
        for s in held:
            s.close()


def test_a_taken_admin_port_fails_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "service"], cwd=REPO, capture_output=True,
                             text=True, timeout=60,
                             env=service_env(HOST="127.0.0.1", PORT=str(free_port()),
                                             ADMIN_PORT=str(port)))
    assert res.returncode == 1, res.stderr
    assert res.stderr == (f"triton-prefill: cannot listen on HOST='127.0.0.1' ADMIN_PORT={port}: "
                          "Address already in use\n")
