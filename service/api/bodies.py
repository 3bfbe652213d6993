"""Big request bodies, parsed holding the event loop little: JSON by msgspec (twice json's
speed), a long array of token ids a piece at a time into int64, off the loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import numpy as np
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MSGSPEC_BODY_BYTES = 1 << 16  # bodies over this size are parsed by msgspec
IDS_PIECE_BYTES = 1 << 18  # bytes of an id array decoded per call
_any = msgspec.json.Decoder()
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ints = msgspec.json.Decoder(list[int])


class FastJSONRequest(Request):
    """A big JSON body parsed (msgspec) and validated (`validate`) in a thread, one at a time;
    what msgspec refuses json parses, and an invalid body is left to FastAPI, for its errors."""

    validate: Callable[[Any], tuple[Any, list]] | None = None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= MSGSPEC_BODY_BYTES:
                self._json = json.loads(body)
            else:
                async with self.app.state.prefill.big_inputs:
                    self._json = await asyncio.to_thread(self._parse, body)
        return self._json

    def _parse(self, body: bytes) -> Any:
        try:
            data = _any.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return json.loads(body)
        if self.validate is None:
            return data
        value, errors = self.validate(data)
        return data if errors else value  # FastAPI passes a validated model through


class FastJSONRoute(APIRoute):
    """A route whose body FastJSONRequest parses."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = None if self._embed_body_fields else self.body_field

        async def route(request: Request) -> Response:
            fast = FastJSONRequest(request.scope, request.receive)
            fast.validate = None if field is None else field.validate
            # NOTE: read through `request`, which the exception handlers get, and shared
            fast._body = await request.body()
            return await handler(fast)

        return route


def parse_ids(raw: bytes) -> np.ndarray | None:
    """The JSON array of integers `raw` as int64, or None when it is anything else."""
    raw = raw.strip()
    if raw[:1] != b"[" or raw[-1:] != b"]":
        return None
    pieces, start, end = [], 1, len(raw) - 1
    while True:
        cut = raw.find(b",", start + IDS_PIECE_BYTES, end)
        try:
            ints = _ints.decode(b"[" + raw[start:end if cut < 0 else cut] + b"]")
            pieces.append(np.array(ints, np.int64))
        except (msgspec.DecodeError, OverflowError):
            return None
        if not ints and (start > 1 or cut >= 0):  # nothing between two commas
            return None
        if cut < 0:
            return np.concatenate(pieces)
        start = cut + 1


def parse_body(raw: bytes, model: type[M], ids_field: str) -> tuple[M, np.ndarray]:
    """`raw` as `model`, its `ids_field` by parse_ids (else validated whole, for the error)."""
    ids = None
    try:
        fields = _fields.decode(raw)
        ids = parse_ids(bytes(fields.pop(ids_field, b"")))
        rest = {k: msgspec.json.decode(v) for k, v in fields.items()}
    except msgspec.DecodeError:
        ids = None
    try:
        if ids is None:
            body = model.model_validate_json(raw)
            return body, np.array(getattr(body, ids_field), np.int64)
        return model.model_validate({**rest, ids_field: []}), ids
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
