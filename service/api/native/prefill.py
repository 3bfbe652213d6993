"""POST /v1/prefill: the native API (one or many prompts, first token, logprobs, timings)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, model_validator

from service.api.deps import State, api_router, json_answer, json_array, logprob_count
from service.api.prompts import (
    check_ids,
    encode_texts,
    named_ids,
    run_prompts,
    sampling_params,
    tokenized,
)
from service.api.schemas import ModelName, Sampling, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import (
    MAX_LOGPROB_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PromptResult,
    TokenLogprob,
)

router = api_router("prefill")


class PrefillRequest(Sampling):
    """Exactly one of `prompt` (one text), `prompts` (texts) or `input_ids` (one or many)."""

    model: ModelName = None
    prompt: Text | None = None
    prompts: list[Text] | None = Field(None, min_length=1)
    input_ids: TokenIds | list[TokenIds] | None = Field(None, min_length=1)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS,
                              description="Alternatives reported for the next token.")
    prompt_logprobs: bool = Field(False, description=(
        "Return the logprob of every prompt token given its prefix (and its top_logprobs)."))
    logprob_token_ids: TokenIds | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "Token ids whose next-token logprobs are returned (`token_logprobs`, in this order) "
            "whatever their rank, at every prompt position too with prompt_logprobs."))

    @model_validator(mode="after")
    def _one_input(self) -> PrefillRequest:
        given = [n for n in ("prompt", "prompts", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, prompts or input_ids"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


class TokenInfo(BaseModel):
    id: int
    text: str
    logprob: float | None


class PromptTokenInfo(TokenInfo):
    top_logprobs: list[TokenInfo] | None = None
    token_logprobs: list[TokenInfo] | None = None


class PrefillResult(BaseModel):
    index: int
    prompt_tokens: int
    cached_tokens: int
    next_token: TokenInfo
    top_logprobs: list[TokenInfo]
    token_logprobs: list[TokenInfo] | None = None  # of the request's logprob_token_ids
    prompt_logprobs: list[PromptTokenInfo] | None = None  # one per prompt token; first: null
    queue_ms: float
    prefill_ms: float
    kv_transfer_params: dict[str, Any] | None = None  # for the decode (KV_TRANSFER)


class PrefillUsage(BaseModel):
    prompt_tokens: int
    cached_tokens: int


class PrefillResponse(BaseModel):
    id: str
    object: Literal["prefill"] = "prefill"
    model: str
    results: list[PrefillResult]
    usage: PrefillUsage


def prompt_ids(state: AppState, body: PrefillRequest) -> list[list[int]]:
    cut = body.truncate_prompt_tokens
    if body.prompt is not None:
        return encode_texts(state, [body.prompt], "prompt", single=True, truncate=cut)
    if body.prompts is not None:
        return encode_texts(state, body.prompts, "prompts", single=False, truncate=cut)
    ids = body.input_ids
    assert ids is not None
    if ids and isinstance(ids[0], list):
        return check_ids(state, ids, "input_ids", False, cut)  # type: ignore[arg-type]
    return check_ids(state, [ids], "input_ids", True, cut)  # type: ignore[list-item]


# The answer is plain dicts as the models dump them: prompt logprobs are too many for models


def _tok(text: Callable[[int], str], t: int, logprob: float | None) -> dict:
    """A TokenInfo."""
    return {"id": t, "text": text(t), "logprob": logprob}


def _toks(text: Callable[[int], str], ts: list[TokenLogprob]) -> list[dict]:
    return [{"id": t, "text": text(t), "logprob": v} for t, v in ts]


def _named(text: Callable[[int], str], named: tuple[int, ...], vals: list[float] | None
           ) -> list[dict] | None:
    return None if vals is None else [_tok(text, t, v) for t, v in zip(named, vals)]


def to_result(state: AppState, i: int, ids: list[int], res: PromptResult,
              named: tuple[int, ...]) -> dict:
    """A PrefillResult; its prompt_logprobs are PromptTokenInfo, one per prompt token."""
    text = state.tokenizer.token_text
    plps = None
    if res.prompt_logprobs is not None:
        first = {**_tok(text, ids[0], None), "top_logprobs": None, "token_logprobs": None}
        plps = json_array(itertools.chain([first], (
            {"id": p.token.id, "text": text(p.token.id), "logprob": p.token.logprob,
             "top_logprobs": _toks(text, p.top) if p.top else None,
             "token_logprobs": _named(text, named, p.named)} for p in res.prompt_logprobs)))
    return {"index": i, "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
            "next_token": _tok(text, *res.next.token), "top_logprobs": _toks(text, res.next.top),
            "token_logprobs": _named(text, named, res.next.named), "prompt_logprobs": plps,
            "queue_ms": round(res.queue_s * 1e3, 3), "prefill_ms": round(res.prefill_s * 1e3, 3),
            "kv_transfer_params": res.kv_transfer}


def to_response(state: AppState, prompts: list[list[int]], results: list[PromptResult],
                named: tuple[int, ...]) -> dict:
    """A PrefillResponse."""
    return {"id": f"prefill-{uuid.uuid4().hex}", "object": "prefill", "model": state.model_name,
            "results": [to_result(state, i, ids, r, named)
                        for i, (ids, r) in enumerate(zip(prompts, results))],
            "usage": {"prompt_tokens": sum(r.prompt_tokens for r in results),
                      "cached_tokens": sum(r.cached_tokens for r in results)}}


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(body: PrefillRequest, state: State, request: Request) -> Response:
    """Prefill each prompt and return its first token (greedy unless temperature > 0)."""
    prompts = await tokenized(state, request, body.model, prompt_ids, state, body)
    params = sampling_params(state, body, top_logprobs=body.top_logprobs,
                             prompt_logprobs=body.prompt_logprobs,
                             logprob_token_ids=named_ids(state, body.logprob_token_ids))
    results = await run_prompts(state, request, prompts, params)
    response = await json_answer(logprob_count(results, params), lambda: to_response(
        state, prompts, results, params.logprob_token_ids))
    state.metrics.count("ok")
    return response
