"""Typed errors and the one table that maps them to HTTP status codes (OpenAI error JSON shape)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.json_depth import TOO_DEEP, deep_path
from service.engine.interface import (
    EngineTimeout,
    ForwardFailed,
    InvalidRequest,
    KVPoolExhausted,
    NotReady,
    QueueFull,
    RequestDropped,
)
from service.text import error_message

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with a message for the client and, optionally, the request field it concerns."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class BadInput(ServiceError):
    """The request is well-formed JSON but asks for something invalid."""


class PromptTooLong(BadInput):
    """A prompt has more tokens than MAX_PROMPT_TOKENS or the model's context."""


class ModelNotFound(ServiceError):
    pass


class Unauthorized(ServiceError):
    pass


class ClientDisconnected(Exception):
    """The client went away; its prompts were cancelled and nothing is sent back."""


# exception type -> (HTTP status, OpenAI error type, prefill_requests_total status label)
ERROR_TABLE: dict[type[BaseException], tuple[int, str, str]] = {
    PromptTooLong: (400, "invalid_request_error", "bad_request"),
    BadInput: (400, "invalid_request_error", "bad_request"),
    RequestValidationError: (400, "invalid_request_error", "bad_request"),
    Unauthorized: (401, "authentication_error", "unauthorized"),
    ModelNotFound: (404, "invalid_request_error", "bad_request"),
    QueueFull: (429, "rate_limit_error", "rejected"),
    NotReady: (503, "service_unavailable", "rejected"),
    KVPoolExhausted: (503, "service_unavailable", "rejected"),
    InvalidRequest: (400, "invalid_request_error", "bad_request"),
    RequestDropped: (503, "service_unavailable", "error"),
    EngineTimeout: (504, "timeout_error", "error"),
    ForwardFailed: (500, "server_error", "error"),
}
# what an engine request can fail with (service.engine.interface), each answered by its row above
ENGINE_ERRORS = (QueueFull, NotReady, KVPoolExhausted, InvalidRequest, RequestDropped,
                 EngineTimeout, ForwardFailed)
RETRY_AFTER_S = {QueueFull: 1, NotReady: 5, RequestDropped: 1}


def classify(exc: BaseException) -> tuple[int, str, str]:
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return 500, "server_error", "error"


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(message: str, type_: str, param: str | None = None,
                code: str | int | None = None) -> bytes:
    """`error_body` as ASCII-escaped JSON: any client string (lone surrogates too) can be echoed."""
    return json.dumps(error_body(message, type_, param, code)).encode()


def _loc(loc: tuple) -> str:
    """("body", "input_ids", "list[list[int]]", 1, 0) -> "input_ids[1][0]"."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "header") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS:
            continue  # a union member's tag, not a field
        else:
            out += f".{part}" if out else part
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errs):
        return "request body is not valid JSON", None
    # A union field fails once per member: report the best match (deepest, then fewest errors)
    branches: dict[str, list] = {}
    for e in errs:
        tag = next((p for p in e.get("loc", ()) if isinstance(p, str) and "[" in p), "")
        branches.setdefault(tag, []).append(e)
    if len(branches) > 1:
        errs = max(branches.values(),
                   key=lambda b: (max(len(e.get("loc", ())) for e in b), -len(b)))
    parts, first = [], None
    for e in errs[:4]:
        field = _loc(tuple(e.get("loc", ())))
        msg = error_message(e)
        first = first or field or None
        parts.append(f"{field}: {msg}" if field else msg)
    return "invalid request: " + "; ".join(dict.fromkeys(parts)), first


def too_deep_body(body: bytes) -> BadInput:
    """The 400 for a body nested too deep for the JSON parser, naming where if it can."""
    where = deep_path(body)
    field = None if where is None else where if len(where) <= 100 else where[:100] + "..."
    return BadInput(f"{field or 'the request body'}: {TOO_DEEP}", field)


class ErrorReply(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes
    label: str  # prefill_requests_total's status label


def reply(exc: BaseException, message: str, param: str | None = None,
          code: str | None = None) -> ErrorReply:
    """What a client gets for `exc`: status, headers (Retry-After, WWW-Authenticate), body."""
    status, type_, label = classify(exc)
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is None:
        retry = next((s for cls, s in RETRY_AFTER_S.items() if isinstance(exc, cls)), None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return ErrorReply(status, headers, error_bytes(message, type_, param, code or status), label)


def install(app: FastAPI, count: Callable[[str], None]) -> None:
    """Register handlers; `count(status_label)` feeds prefill_requests_total."""

    def respond(exc: BaseException, message: str, param: str | None,
                code: str | None) -> Response:
        r = reply(exc, message, param, code)
        if r.status == 500:
            log.warning("%d: %s", r.status, message)
        count(r.label)
        return Response(r.body, r.status, headers=r.headers, media_type="application/json")

    @app.exception_handler(ServiceError)
    async def _service(_: Request, exc: ServiceError) -> Response:
        return respond(exc, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return respond(exc, message, param, None)

    async def _engine(_: Request, exc: Exception) -> Response:
        return respond(exc, str(exc), None, None)

    for cls in ENGINE_ERRORS:
        app.add_exception_handler(cls, _engine)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's JSON parse of the body
            bad = too_deep_body(await request.body())
            return respond(bad, bad.message, bad.param, None)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return Response(error_bytes(str(exc.detail), type_, None, exc.status_code),
                        exc.status_code, headers=getattr(exc, "headers", None),
                        media_type="application/json")
