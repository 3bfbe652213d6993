"""Annotated dependencies (the app state, the bearer-token check) and the JSON response."""

from __future__ import annotations

import asyncio
import hmac
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from service.api.bodies import FastJSONRoute
from service.api.errors import Unauthorized
from service.api.state import AppState
from service.engine.interface import PromptResult, SamplingParams

# Logprobs an answer may report and still be built on the event loop (a few milliseconds)
INLINE_LOGPROBS = 4096
JSON_PIECE = 256  # items of a json_array made and encoded at a time
JSON_IDS_PIECE = 1 << 16  # ids of a json_ids encoded at a time
_encoder = msgspec.json.Encoder()


# NOTE: async, though neither awaits: FastAPI runs a plain `def` dependency in its thread pool
async def get_state(request: Request) -> AppState:
    return request.app.state.prefill


State = Annotated[AppState, Depends(get_state)]


def json_response(body: BaseModel) -> Response:
    """`body` serialized once (returning it, FastAPI would dump, re-validate and encode it)."""
    return Response(body.model_dump_json(), media_type="application/json")


def logprob_count(results: Sequence[PromptResult], params: SamplingParams) -> int:
    """The logprobs an answer to `params` reports: per position, the token's, top and named."""
    positions = sum(1 + len(r.prompt_logprobs or ()) for r in results)
    return positions * (1 + params.top_logprobs + len(params.logprob_token_ids))


def json_array(items: Iterable[Any]) -> msgspec.Raw:
    """`items` as one JSON array, encoded JSON_PIECE at a time: no C call holds the GIL long."""
    it, parts = iter(items), []
    while piece := list(itertools.islice(it, JSON_PIECE)):
        parts.append(_encoder.encode(piece)[1:-1])
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


def json_ids(ids: np.ndarray) -> msgspec.Raw:
    """`ids` as one JSON array, encoded JSON_IDS_PIECE at a time (as json_array)."""
    return msgspec.Raw(b"[" + b",".join(
        _encoder.encode(ids[i:i + JSON_IDS_PIECE].tolist())[1:-1]
        for i in range(0, len(ids), JSON_IDS_PIECE)) + b"]")


def parts_response(parts: list[bytes]) -> Response:
    """The JSON answer `parts` make, sent a part at a time: no join holds the loop for long."""
    async def chunks() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return StreamingResponse(chunks(), media_type="application/json",
                             headers={"Content-Length": str(sum(map(len, parts)))})


async def json_answer(logprobs: int, build: Callable[[], BaseModel | Any]) -> Response:
    """The JSON of `build()`: a pydantic model, or plain data (msgspec; a non-finite float is
    null, as in pydantic). Past INLINE_LOGPROBS logprobs it is built in a thread: megabytes of it
    would hold the loop; the GIL's turns (GIL_SWITCH_INTERVAL_S) bound the loop's wait."""

    def encode() -> bytes | str:
        body = build()
        return body.model_dump_json() if isinstance(body, BaseModel) else _encoder.encode(body)

    content = encode() if logprobs <= INLINE_LOGPROBS else await asyncio.to_thread(encode)
    return Response(content, media_type="application/json")


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


def api_router(tag: str, prefix: str = "/v1", fast_json: bool = True) -> APIRouter:
    """A router behind the API key; `fast_json`: big bodies parsed off the loop (FastJSONRoute)."""
    return APIRouter(prefix=prefix, tags=[tag], dependencies=[Depends(require_api_key)],
                     **({"route_class": FastJSONRoute} if fast_json else {}))
