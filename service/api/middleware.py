"""Pure-ASGI body-size limit, enforced before any parsing (Content-Length and streamed size)."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import error_body


class BodyLimit:
    """Reject bodies over `max_bytes` with 413; the body is buffered (FastAPI buffers it anyway)
    and replayed to the app, after which `receive` passes through (disconnect detection)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = lambda: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def _reject(self, send: Send, size: int | str) -> None:
        self.on_reject()
        body = json.dumps(error_body(
            f"request body is {size} bytes; the limit is {self.max_bytes} (MAX_BODY_BYTES)",
            "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

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
