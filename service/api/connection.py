"""The HTTP/1.1 connection: uvicorn's httptools protocol with limits on what a client holds; a POST
to /v1/ that cannot be queued is answered from its head, and a close lingers for the client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import error_bytes, reply

log = logging.getLogger(__name__)

# Half-closed linger after an error: closing on unread input resets and can lose the response
LINGER_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def raw_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                 close: bool = True) -> bytes:
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in headers]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    head.append(b"connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(head) + body


class _Answered:
    """The cycle of a request answered from its head: the parser callbacks ignore its body."""

    response_complete = response_started = True
    disconnected = more_body = False
    message_event = asyncio.Event()  # set() only, by connection_lost
    body = bytearray()  # stays empty: on_body returns before appending


ANSWERED = _Answered()


class _Lingering:
    """The transport uvicorn sees: a close while the body comes in lingers, so a 413 is read."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.in_body:
            self._protocol._linger()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()


class GuardedProtocol(HttpToolsProtocol):
    """Build with functools.partial for uvicorn.Config(http=...); `refusal()` may refuse early."""

    def __init__(self, *args: Any, limits: ConnectionLimits,
                 count: Callable[[str], None] = lambda label: None,
                 refusal: Callable[[], Exception | None] = lambda: None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits, self.count, self.refusal = limits, count, refusal
        self._in_head = True  # between messages or inside a request head
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._raw: asyncio.Transport | None = None  # the transport under _Lingering

    @property
    def in_body(self) -> bool:
        """A request's head is in and its body is not: the client may still be sending."""
        return not self._in_head and self.parser is not None

    @property
    def idle(self) -> bool:
        """Between requests or inside a head: nothing of this connection's runs in the app."""
        return self._in_head and (self.cycle is None or self.cycle.response_complete)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Lingering(transport, self))  # type: ignore[arg-type]
        if self.admit():
            self._arm(self.limits.header_timeout_s, self._head_timeout)

    def admit(self) -> bool:
        """Whether to serve this new connection; a refused one is answered and closed."""
        if len(self.connections) <= self.limits.max_connections:
            return True
        self._refuse(503, "service_unavailable", "too_many_connections", "rejected",
                     f"the server holds {self.limits.max_connections} connections "
                     "(MAX_CONNECTIONS); retry later")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._timer is None:  # the first byte of a request on a kept-alive connection
                self._arm(self.limits.header_timeout_s, self._head_timeout)
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket here: served as plain HTTP
        except httptools.HttpParserError as e:
            self._refuse(400, "invalid_request_error", "malformed_request", "bad_request",
                         f"malformed HTTP request: {e}")
            return
        if (self._in_head and self._head_bytes > self.limits.max_header_bytes
                and not self.transport.is_closing()):
            self._refuse(431, "invalid_request_error", "request_header_too_large", "bad_request",
                         f"the request head is over {self.limits.max_header_bytes} bytes "
                         "(MAX_HEADER_BYTES)")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, self._body_timeout)
        if (self.url.startswith(b"/v1/") and self.parser.get_method() == b"POST"
                and (self.cycle is None or self.cycle.response_complete)
                and (exc := self.refusal()) is not None):
            self._answer_from_head(exc)
            return
        super().on_headers_complete()

    def _answer_from_head(self, exc: Exception) -> None:
        r = reply(exc, str(exc))
        self.count(r.label)
        keep = r.status == 429 and self.parser.should_keep_alive()
        headers = [*self.server_state.default_headers,
                   *((k.lower().encode(), v.encode()) for k, v in r.headers.items())]
        self.transport.write(raw_response(r.status, r.body, headers, close=not keep))
        self.cycle = ANSWERED  # type: ignore[assignment]
        if keep:
            self.on_response_complete()  # arms the keep-alive timeout, as after any response
        else:
            self._linger()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self._head_bytes == 0 and self.cycle is None:
            self.transport.close()  # connected and sent nothing: no request to answer
            return
        if self._head_bytes == 0:
            return  # between requests: the keep-alive timeout is uvicorn's
        self._refuse(408, "invalid_request_error", "request_timeout", "bad_request",
                     f"the request head was not complete within {self.limits.header_timeout_s:g}"
                     " s (HEADER_TIMEOUT_S)")

    def _body_timeout(self) -> None:
        self._timer = None
        self._refuse(408, "invalid_request_error", "request_timeout", "bad_request",
                     f"the request body was not complete within {self.limits.body_timeout_s:g} s"
                     " (BODY_TIMEOUT_S)")

    def send_400_response(self, msg: str) -> None:  # uvicorn's own call sites
        self._refuse(400, "invalid_request_error", "malformed_request", "bad_request", msg)

    def _refuse(self, status: int, type_: str, code: str, label: str, message: str) -> None:
        """Answer `status` with a JSON error (unless a response is under way) and close."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self._in_head:
            self._raw.close()  # the body of a request already answered (e.g. a 429)
            return
        if cycle is not None and not cycle.response_complete:
            # NOTE: the app's receive() now returns http.disconnect; its sends are dropped
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self._raw.close()
                return
        log.debug("%s: %d %s", self.client, status, message)
        self.count(label)
        body = error_bytes(message, type_, None, code)
        self.transport.write(raw_response(status, body, self.server_state.default_headers))
        self._linger()

    def _linger(self) -> None:
        """Shut the write side, discard what the client sends, close after LINGER_S or its EOF."""
        self._disarm()
        raw = self._raw
        assert raw is not None, "connection_made sets the raw transport"
        if self._lingering or raw.is_closing():
            return
        if not raw.can_write_eof():
            raw.close()
            return
        raw.write_eof()
        self._lingering = True
        self.flow.resume_reading()  # uvicorn pauses it under a large body
        self.loop.call_later(LINGER_S, raw.close)
