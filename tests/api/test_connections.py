"""The connection layer under hostile clients: malformed requests, huge heads, slow heads and
bodies, too many connections, errors raised past every handler. Raw sockets against the app
served the way the CLI serves it."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.api.conftest import metric

TLS_CLIENT_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\x00\x00\x02\x13\x01"


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=timeout)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_response(sock: socket.socket) -> bytes:
    """One response (head and Content-Length body) from a connection that stays open."""
    def more() -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-response"
        return chunk

    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += more()
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                       if ln.lower().startswith(b"content-length:")), b"0"))
    while len(body) < length:
        body += more()
    return head + b"\r\n\r\n" + body


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, json.loads(body)


def exchange(url: str, data: bytes) -> tuple[int, dict[str, str], dict]:
    with connect(url) as s:
        s.sendall(data)
        return parse(read_all(s))


@pytest.mark.parametrize("data,needle", [
    (b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "Content-Length"),
    (b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n",
     "malformed"),
    (TLS_CLIENT_HELLO, "malformed"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "malformed"),
], ids=["content-length", "chunk-size", "tls-on-plain-port", "header-line"])
def test_malformed_http_gets_a_json_400(served, data, needle) -> None:
    url = served()
    status, headers, body = exchange(url, data)
    assert status == 400 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "malformed_request" and needle.lower() in json.dumps(
        body).lower(), body
    assert metric(httpx.get(url + "/metrics").text, "prefill_requests_total",
                  status="bad_request") >= 1


def test_oversized_head_gets_431_before_authentication(served) -> None:
    url = served(api_key="secret", max_header_bytes=65536)
    head = (b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n"
            b"Content-Length: 2\r\n\r\n{}")
    with connect(url) as s:
        try:
            s.sendall(head)
        except OSError:
            pass  # the server may close before it has read everything
        status, headers, body = parse(read_all(s))
    assert status == 431 and body["error"]["code"] == "request_header_too_large"
    assert "MAX_HEADER_BYTES" in body["error"]["message"]
    ok = httpx.get(url + "/health", headers={"X-Fine": "a" * 60_000})
    assert ok.status_code == 200


def test_slow_heads_and_bodies_are_timed_out(served) -> None:
    """Partial heads, partial bodies and silent connections are all closed after their
    timeouts; a request whose Content-Length exceeds what it sends does not wait forever."""
    url = served(header_timeout_s=0.5, body_timeout_s=0.5)
    partial_heads = [connect(url) for _ in range(40)]
    partial_bodies = [connect(url) for _ in range(40)]
    silent = [connect(url) for _ in range(20)]
    for s in partial_heads:
        s.sendall(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Ty")
    for s in partial_bodies:
        s.sendall(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Hi")
    for group, code in ((partial_heads, "request_timeout"), (partial_bodies, "request_timeout")):
        for s in group:
            status, _, body = parse(read_all(s))
            assert status == 408 and body["error"]["code"] == code
            s.close()
    for s in silent:
        assert read_all(s) == b""  # closed without an answer: there was no request
        s.close()
    r = httpx.post(url + "/v1/prefill", json={"prompt": "Hi"})
    assert r.status_code == 200


def test_connections_beyond_the_cap_get_503(served) -> None:
    url = served(max_connections=5)
    held = [connect(url) for _ in range(5)]
    try:
        time.sleep(0.2)  # the server has accepted them
        status, headers, body = exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert "MAX_CONNECTIONS" in body["error"]["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(url + "/health").status_code == 200


def test_an_error_past_every_handler_is_a_json_500(served) -> None:
    url = served()

    class Broken:
        def encode_within(self, text: str, limit: int, add_special: bool = True) -> list[int]:
            raise ZeroDivisionError("tokenizer exploded")

    state = served.live.state
    real, state.tokenizer = state.tokenizer, Broken()
    try:
        r = httpx.post(url + "/v1/prefill", json={"prompt": "Hello"})
    finally:
        state.tokenizer = real
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert "ZeroDivisionError: tokenizer exploded" in r.json()["error"]["message"]
    assert metric(httpx.get(url + "/metrics").text, "prefill_requests_total",
                  status="error") == 1


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_reads_its_413_never_a_reset(served, framing) -> None:
    """A client that sends all of its 9 MB body before it reads (as most do) gets the 413 and
    a clean close every time: the server reads and discards the rest before it closes."""
    url = served()
    body = b"x" * 9_000_000
    if framing == "chunked":
        step = 1 << 16
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                        for i in range(0, len(body), step)) + b"0\r\n\r\n"
        head = b"Transfer-Encoding: chunked"
    else:
        head = b"Content-Length: %d" % len(body)
    request = (b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + head + b"\r\n\r\n" + body)
    for _ in range(30 if framing == "content-length" else 10):
        with connect(url) as s:
            s.sendall(request)  # a reset raises here, or in read_all
            status, headers, reply = parse(read_all(s))
        assert status == 413 and reply["error"]["code"] == "request_too_large", reply
        assert headers["connection"] == "close"
