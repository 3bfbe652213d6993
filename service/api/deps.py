"""Annotated dependencies: the app state and the bearer-token check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from service.api.errors import Unauthorized
from service.api.state import AppState


# NOTE: async, though neither awaits: FastAPI runs a plain `def` dependency in its thread pool
async def get_state(request: Request) -> AppState:
    return request.app.state.prefill


State = Annotated[AppState, Depends(get_state)]


async def require_api_key(state: State,
                    authorization: Annotated[str | None, Header()] = None) -> None:
    """With API_KEY set, demand `Authorization: Bearer <key>` (constant-time comparison)."""
    key = state.server_cfg.api_key
    if not key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized("missing or invalid API key: send `Authorization: Bearer <API_KEY>`",
                           code="invalid_api_key")
