"""The admin listener (ADMIN_PORT), served by a process of its own: probes and scrapes only.
However many connections anyone holds open, a new one is served: idle ones close fast, and past
the allowance the oldest idle ones are shed."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.connection import ConnectionLimits, GuardedProtocol
from service.api.errors import error_bytes
from service.api.middleware import send_json

log = logging.getLogger(__name__)

# A kubelet's three probes and a few Prometheus replicas need a handful at a time
ADMIN_MAX_CONNECTIONS = 64
# A probe sends its request at once and reads the answer: longer idle is a scanner's
ADMIN_IDLE_S = 2.0
# A new connection's time to send its request before it may be shed (a probe amid a burst)
ADMIN_GRACE_S = 0.1
ADMIN_PATHS = frozenset({"/health", "/ready", "/metrics"})
ADMIN_METHODS = frozenset({"GET", "HEAD"})
NOT_SERVED = ("the admin port (ADMIN_PORT) serves only GET /health, /ready and /metrics; "
              "send other requests to PORT")


class AdminOnly:
    """ASGI: GET and HEAD of ADMIN_PATHS go to the app, anything else is a JSON 404."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] in ADMIN_METHODS
                                       and scope["path"] in ADMIN_PATHS):
            await self.app(scope, receive, send)
            return
        await send_json(send, 404, error_bytes(NOT_SERVED, "invalid_request_error", None, 404))


class AdminProtocol(GuardedProtocol):
    """An ADMIN_PORT connection. `held`, one per server, holds the open ones oldest first."""

    def __init__(self, *args: Any, held: dict[AdminProtocol, None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.held = held
        self.app = AdminOnly(self.app)  # per request, pipelined ones included
        self.opened = 0.0  # loop time, set by admit()

    def admit(self) -> bool:
        """Always. Past the allowance, connections older than ADMIN_GRACE_S go: idle ones
        first, oldest first (then busy ones, e.g. waiting on a client that does not read)."""
        self.opened = now = self.loop.time()
        self.held[self] = None
        excess = len(self.held) - ADMIN_MAX_CONNECTIONS
        if excess > 0:
            old = [p for p in self.held if now - p.opened >= ADMIN_GRACE_S]
            for p in sorted(old, key=lambda p: not p.idle)[:excess]:
                del self.held[p]
                p.drop()
            log.debug("shed %d admin connections; %d held", min(excess, len(old)), len(self.held))
        return True

    def drop(self) -> None:
        """Close now: an idle connection with a FIN, a busy one (its client not reading) reset."""
        self._disarm()
        if self._raw is not None:
            (self._raw.close if self.idle else self._raw.abort)()

    def connection_lost(self, exc: Exception | None) -> None:
        self.held.pop(self, None)
        super().connection_lost(exc)


def admin_protocol(max_header_bytes: int, count: Callable[[str], None]) -> Callable[..., Any]:
    """uvicorn.Config(http=...) for the admin server: heads and bodies end after ADMIN_IDLE_S."""
    limits = ConnectionLimits(max_header_bytes, ADMIN_IDLE_S, ADMIN_IDLE_S, ADMIN_MAX_CONNECTIONS)
    return functools.partial(AdminProtocol, limits=limits, count=count, held={})
