"""Annotated dependencies (the app state, the bearer-token check) and the JSON response."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel

from service.api.errors import Unauthorized
from service.api.state import AppState


# NOTE: async, though neither awaits: FastAPI runs a plain `def` dependency in its thread pool
async def get_state(request: Request) -> AppState:
    return request.app.state.prefill


State = Annotated[AppState, Depends(get_state)]


def json_response(body: BaseModel) -> Response:
    """`body` serialized once, by pydantic; the route's response_model stays for the schema.
    (Returning the model would make FastAPI dump, re-validate and encode it: three passes.)"""
    return Response(body.model_dump_json(), media_type="application/json")


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
