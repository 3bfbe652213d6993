"""POST /v1/score: SGLang's scoring API (vLLM's text_1/text_2 go to retrieval/pair_score.py).
Every item is scored as query + item by the next-token probabilities of the label tokens; the
items' shared query is prefilled once for all of them."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.api.deps import State, api_router, json_answer, logprob_count
from service.api.errors import BadInput
from service.api.prompts import (
    check_vocab,
    encode_texts,
    named_ids,
    run_prompts,
    tokenized,
    too_long,
)
from service.api.retrieval.pair_score import is_pair_body, pair_score
from service.api.schemas import Body, ModelName, PromptTokensDetails, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from service.engine.pages import common_prefix

router = api_router("score", fast_json=False)


class ScoreRequest(Body):
    """SGLang's /v1/score body: items scored as `query + item` (`item + query` with item_first)."""

    model: ModelName = None
    query: Text | TokenIds | None = Field(None, description=(
        "Text, or token ids (then items are token ids too); empty: the items are whole prompts."))
    items: Text | list[Text] | list[TokenIds] | None = None
    label_token_ids: TokenIds | None = Field(
        None, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "Tokens whose next-token probabilities make each item's scores, in this order."))
    apply_softmax: bool = Field(False, description=(
        "Normalise each item's scores over the labels; else each is the token's probability "
        "under the full vocabulary."))
    item_first: bool = False


class ScoreUsage(BaseModel):
    prompt_tokens: int  # of every query + item prompt, as if each were prefilled alone
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # cached: the query's KV reused, prefix cache


class ScoreResponse(BaseModel):
    scores: list[list[float]]  # per item, per label
    model: str
    usage: ScoreUsage
    object: Literal["scoring"] = "scoring"


def score_prompts(state: AppState, body: ScoreRequest) -> list[np.ndarray]:
    """Token ids of every query + item (item + query) prompt, checked."""
    query, items = body.query, body.items
    if query is None:
        raise BadInput("query is required (text or token ids; empty for whole-prompt items)",
                       "query")
    if items is None or (isinstance(items, list) and not items):
        raise BadInput("items is required: a text, a list of texts or a list of token-id lists",
                       "items")
    if not body.label_token_ids:
        raise BadInput("label_token_ids is required: the tokens whose probabilities score each "
                       "item", "label_token_ids")
    items = [items] if isinstance(items, str) else items
    if len(items) > (most := state.engine_cfg.max_queue_requests):
        raise BadInput(f"items: {len(items)} in one request; at most {most} "
                       "(MAX_QUEUE_REQUESTS)", "items")
    first = body.item_first
    if isinstance(query, str):
        if not all(isinstance(it, str) for it in items):
            raise BadInput("items must be texts when query is a text", "items")
        if query:
            encode_texts(state, [query], "query", single=True)  # an over-long query is named
        texts = [it + query if first else query + it for it in items]
        return [np.asarray(p, np.int32) for p in encode_texts(state, texts, "items", False)]
    if not all(isinstance(it, list) for it in items):
        raise BadInput("items must be token-id lists when query is token ids", "items")
    # the query's ids are checked once, each item's apart, then the length of each prompt
    vocab, limit = state.engine.info.vocab_size, state.max_prompt_tokens
    q = np.asarray(query, np.int64)
    check_vocab(q, vocab, "query")
    if len(q) > limit:
        raise too_long("query", str(len(q)), state)
    out = []
    for i, it in enumerate(items):
        a = np.asarray(it, np.int64)
        check_vocab(a, vocab, f"items[{i}]")
        if not len(q) + len(a):
            raise BadInput(f"items[{i}] is empty (no tokens), and so is the query", f"items[{i}]")
        if len(q) + len(a) > limit:
            raise too_long(f"items[{i}]", f"{len(q) + len(a)} (query + item)", state)
        out.append(np.concatenate([a, q] if first else [q, a]).astype(np.int32))
    return out


# A shared query's own forward pays once it saves this many tokens (shared x (items - 1))
MIN_SAVED_TOKENS = 512


def shared_tokens(state: AppState, prompts: list[np.ndarray]) -> int:
    """The tokens every prompt shares, when prefilling them once pays: a KV page, MIN_SAVED_TOKENS
    saved, and a token of its own left to each prompt."""
    if len(prompts) < 2:
        return 0
    shared = min(common_prefix(prompts), min(map(len, prompts)) - 1)
    if shared < state.engine.info.page_size or shared * (len(prompts) - 1) < MIN_SAVED_TOKENS:
        return 0
    return shared


def scores(logprobs: list[float], softmax: bool) -> list[float]:
    """SGLang's scores: a softmax over the labels, or each label's probability."""
    if not softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)
    e = [math.exp(x - top) for x in logprobs]
    total = sum(e)
    return [x / total for x in e]


@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, state: State, request: Request) -> Response:
    """Score each item against the query by the label tokens' next-token probabilities."""
    if is_pair_body(raw := body.model_dump(exclude_unset=True)):
        return await pair_score(raw, state, request)
    prompts = await tokenized(state, request, body.model, score_prompts, state, body)
    labels = named_ids(state, body.label_token_ids, "label_token_ids")
    shared = shared_tokens(state, prompts)
    params = SamplingParams(logprob_token_ids=labels)
    results = await run_prompts(state, request, prompts, params, shared)
    tokens = sum(r.prompt_tokens for r in results)

    def answer() -> ScoreResponse:  # items x labels scores: megabytes with thousands of items
        return ScoreResponse(
            scores=[scores(r.next.named, body.apply_softmax) for r in results],
            model=state.model_name,
            usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens,
                             prompt_tokens_details=PromptTokensDetails(
                                 cached_tokens=sum(r.cached_tokens for r in results))))

    response = await json_answer(logprob_count(results, params), answer)
    state.metrics.on_score(len(prompts), shared)
    state.metrics.count("ok")
    return response
