"""The admin listener (ADMIN_PORT): probes and scrapes only, with a connection allowance apart
from MAX_CONNECTIONS, so a flood of client connections on PORT cannot fail them."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import error_bytes
from service.api.middleware import send_json

# Per worker: a kubelet's three probes and a few Prometheus replicas need a handful at a time
ADMIN_MAX_CONNECTIONS = 64
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
