"""Pure-ASGI middleware, outermost first: Guard (JSON 500s, draining) and BodyLimit (413)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import error_bytes

log = logging.getLogger(__name__)


async def send_json(send: Send, status: int, body: bytes,
                    headers: dict[str, str] | None = None, close: bool = False) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Unhandled exceptions become a JSON 500; while `draining()`, send `Connection: close`."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool],
                 count: Callable[[str], None]):
        self.app, self.draining, self.count = app, draining, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def guarded(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                if self.draining():
                    msg = {**msg, "headers": [*msg.get("headers", ()),
                                              (b"connection", b"close")]}
            await send(msg)

        try:
            await self.app(scope, receive, guarded)
        except Exception as exc:  # noqa: BLE001 - the last place an error can become a response
            log.error("unhandled error in %s %s", scope["method"], scope["path"], exc_info=exc)
            if started:
                return  # half a response is out: the server closes the connection
            self.count("error")
            await send_json(send, 500, error_bytes(
                f"internal error: {type(exc).__name__}: {exc}", "server_error", None, 500),
                close=self.draining())


class BodyLimit:
    """413 for bodies over `max_bytes`; the buffered body is replayed, then `receive` passes."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = lambda: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def _reject(self, send: Send, size: int | str) -> None:
        self.on_reject()
        await send_json(send, 413, error_bytes(
            f"request body is {size} bytes; the limit is {self.max_bytes} (MAX_BODY_BYTES)",
            "invalid_request_error", None, "request_too_large"), close=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._reject(send, declared)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send, f"more than {size}")
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
