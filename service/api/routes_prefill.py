"""POST /v1/prefill: the native API (one or many prompts, first token, logprobs, timings)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.deps import State, json_response, require_api_key
from service.api.prompts import check_ids, encode_texts, named_ids, run_prompts, tokenized
from service.api.schemas import (
    PrefillRequest,
    PrefillResponse,
    PrefillResult,
    PrefillUsage,
    PromptTokenInfo,
    TokenInfo,
)
from service.api.state import AppState
from service.engine.interface import PromptResult, SamplingParams, TokenLogprob

router = APIRouter(prefix="/v1", tags=["prefill"], dependencies=[Depends(require_api_key)])


def prompt_ids(state: AppState, body: PrefillRequest) -> list[list[int]]:
    if body.prompt is not None:
        return encode_texts(state, [body.prompt], "prompt", single=True)
    if body.prompts is not None:
        return encode_texts(state, body.prompts, "prompts", single=False)
    ids = body.input_ids
    assert ids is not None
    if ids and isinstance(ids[0], list):
        return check_ids(state, ids, "input_ids", single=False)  # type: ignore[arg-type]
    return check_ids(state, [ids], "input_ids", single=True)  # type: ignore[list-item]


def _tok(state: AppState, t: TokenLogprob) -> TokenInfo:
    return TokenInfo(id=t.id, text=state.tokenizer.token_text(t.id), logprob=t.logprob)


def _toks(state: AppState, ts: list[TokenLogprob] | None) -> list[TokenInfo] | None:
    return None if ts is None else [_tok(state, t) for t in ts]


def _named(state: AppState, named: tuple[int, ...], vals: list[float] | None
           ) -> list[TokenInfo] | None:
    return None if vals is None else [_tok(state, TokenLogprob(t, v))
                                      for t, v in zip(named, vals)]


def to_result(state: AppState, i: int, ids: list[int], res: PromptResult,
              named: tuple[int, ...]) -> PrefillResult:
    plps = None
    if res.prompt_logprobs is not None:
        text = state.tokenizer.token_text
        plps = [PromptTokenInfo(id=ids[0], text=text(ids[0]), logprob=None)]
        plps += [PromptTokenInfo(id=p.token.id, text=text(p.token.id), logprob=p.token.logprob,
                                 top_logprobs=_toks(state, p.top) if p.top else None,
                                 token_logprobs=_named(state, named, p.named))
                 for p in res.prompt_logprobs]
    return PrefillResult(
        index=i, prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
        next_token=_tok(state, res.next.token), top_logprobs=_toks(state, res.next.top),
        token_logprobs=_named(state, named, res.next.named), prompt_logprobs=plps,
        queue_ms=round(res.queue_s * 1e3, 3), prefill_ms=round(res.prefill_s * 1e3, 3))


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(body: PrefillRequest, state: State, request: Request) -> Response:
    """Prefill each prompt and return its first token (greedy unless temperature > 0)."""
    prompts = await tokenized(state, request, body.model, prompt_ids, state, body)
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            seed=body.seed, top_logprobs=body.top_logprobs,
                            prompt_logprobs=body.prompt_logprobs,
                            logprob_token_ids=named_ids(state, body.logprob_token_ids))
    results = await run_prompts(state, request, prompts, params)
    out = [to_result(state, i, ids, r, params.logprob_token_ids)
           for i, (ids, r) in enumerate(zip(prompts, results))]
    state.metrics.count("ok")
    return json_response(PrefillResponse(
        id=f"prefill-{uuid.uuid4().hex}", model=state.model_name, results=out,
        usage=PrefillUsage(prompt_tokens=sum(r.prompt_tokens for r in out),
                           cached_tokens=sum(r.cached_tokens for r in out))))
