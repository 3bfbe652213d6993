"""vLLM's POST /score (and /v1/score beside SGLang's shape): each pair's score head activation."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from service.api.deps import State, api_router
from service.api.errors import BadInput
from service.api.retrieval.rerank import RerankRequest, answer, scores
from service.api.schemas import Text
from service.api.state import AppState

router = api_router("retrieval", prefix="")
SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
         ("data_1", "data_2"))
KEYS = {k for side in SIDES for k in side} - {"items"}  # SGLang's shape sends `items` too


class PairScoreRequest(RerankRequest):
    query: Text | list[Text] | None = None
    text_1: Text | list[Text] | None = None
    text_2: Text | list[Text] | None = None
    queries: Text | list[Text] | None = None
    items: Text | list[Text] | None = None
    data_1: Text | list[Text] | None = None
    data_2: Text | list[Text] | None = None


def is_pair_body(body: dict) -> bool:
    return bool(KEYS & set(body))


def sides(body: PairScoreRequest) -> tuple[list[str], list[str]]:
    """The pairs' two sides, one query broadcast over N documents or N paired with N."""
    given = [(a, b) for a, b in SIDES if getattr(body, a) is not None
             and getattr(body, b) is not None]
    if len(given) != 1 or body.query is not None:
        raise BadInput("send text_1 and text_2 (or queries and documents), once", "text_1")
    a, b = ([v] if isinstance(v, str) else v for v in (getattr(body, k) for k in given[0]))
    if not a or not b:
        raise BadInput(f"{given[0][0] if not a else given[0][1]} is empty", given[0][not a])
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise BadInput(f"{given[0][0]} has {len(a)} texts and {given[0][1]} {len(b)}: send one "
                       "or as many", given[0][0])
    return a, b


async def pair_score(raw: dict, state: AppState, request: Request) -> Response:
    if "label_token_ids" in raw:
        raise BadInput("label_token_ids is SGLang's shape (query, items), text_1/text_2 "
                       "vLLM's: send one", "label_token_ids")
    try:
        body = PairScoreRequest.model_validate(raw)
    except ValidationError as e:
        loc = ".".join(map(str, e.errors()[0]["loc"]))
        raise BadInput(f"{loc}: {e.errors()[0]['msg']}", loc) from None
    a, b = sides(body)
    vals, tokens = await scores(state, request, body.model_copy(update={"query": a}), b,
                                body.max_tokens_per_doc, "score")
    return await answer(state, {
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(vals)]},
                        len(vals))


@router.post("/score")
async def score(request: Request, state: State) -> Response:
    """vLLM's shape: text_1/text_2, queries/documents (or items), data_1/data_2."""
    try:
        raw = await request.json()
    except ValueError:
        raise BadInput("the body is not JSON", "body") from None
    if not isinstance(raw, dict):
        raise BadInput("the body must be a JSON object", "body")
    return await pair_score(raw, state, request)
