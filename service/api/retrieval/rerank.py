"""Rerank on the score head: vLLM/Jina's and TEI's POST /rerank and /v1/rerank (told apart by
their fields), Cohere's /v2/rerank."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.prompts import check_ids, run_prompts, tokenized
from service.api.retrieval.classify import head_scores, require_head
from service.api.schemas import Body, ModelName, Text
from service.api.state import AppState
from service.engine.interface import MAX_INT32, SamplingParams

router = api_router("retrieval", prefix="")
# Qwen3-Reranker's model-card prompt (vLLM's qwen3_reranker.jinja renders the same tokens)
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
                "\"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_TASK = "Given a web search query, retrieve relevant passages that answer the query"
COHERE_DOC_TOKENS = 4096  # Cohere's documented max_tokens_per_doc default


class Document(BaseModel):
    text: Text


class RerankRequest(Body):
    model: ModelName = None
    query: Text | list[Text]  # a list: one query per document (vLLM's /score)
    documents: list[Text | Document] | None = Field(None, description=(
        "Texts, or {text} objects (Jina); TEI's body sends `texts` instead."))
    texts: list[Text] | None = Field(None, description="TEI's documents: a bare array answers.")
    top_n: int | None = Field(None, ge=0, le=MAX_INT32, description="0 or unset: all.")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32, description=(
        "Keep only each pair's last k tokens; unset: an over-long pair is a 400."))
    max_tokens_per_doc: int | None = Field(None, ge=1, le=MAX_INT32, description=(
        "Cut each document to its first n tokens."))
    use_activation: bool | None = None
    raw_scores: bool = False  # TEI's use_activation=false
    return_text: bool = False
    truncate: bool | None = Field(None, description=(
        "TEI: cut an over-long pair to the longest prompt served, at `truncation_direction`."))
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"


def texts(docs: list[str | Document]) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in docs]


def pair(state: AppState, query: str, doc: str) -> list[int]:
    """A (query, document) prompt: Qwen3-Reranker's template, else the tokenizer's pair."""
    if state.engine.info.head == "yes-no":
        return state.tokenizer.encode(f"{QWEN3_PREFIX}<Instruct>: {QWEN3_TASK}\n<Query>: {query}"
                                      f"\n<Document>: {doc}{QWEN3_SUFFIX}", add_special=False)
    return state.tokenizer.encode_pair(query, doc)


def pair_ids(state: AppState, query: str | list[str], docs: list[str], per_doc: int | None,
             cut: int | str | None) -> list[list[int]]:
    """Each (query, document) prompt, checked; one query, or one per document."""
    tok = state.tokenizer
    if per_doc is not None:
        ids = [tok.encode(d, add_special=False) for d in docs]
        docs = [tok.decode(i[:per_doc]) if len(i) > per_doc else d for i, d in zip(ids, docs)]
    queries = [query] * len(docs) if isinstance(query, str) else query
    prompts = [pair(state, q, d) for q, d in zip(queries, docs)]
    if cut == 0:
        raise BadInput("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    if isinstance(cut, str):  # TEI's truncation: `cut` names the side that goes
        n = state.max_prompt_tokens
        prompts = [p[:n] if cut == "right" else p[-n:] for p in prompts]
        cut = None
    return check_ids(state, prompts, "documents", False, cut)


def shared_len(state: AppState, prompts: list[list[int]]) -> int:
    """The tokens every prompt starts with, prefilled once when that saves a page per prompt."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(map(len, prompts)) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n if n >= state.engine.info.page_size else 0


async def scores(state: AppState, request: Request, body: RerankRequest, docs: list[str],
                 per_doc: int | None, task: str = "rerank") -> tuple[list[float], int]:
    """Each document's relevance to the query (the 1-label head's activation) and the tokens."""
    require_head(state)
    if len(state.engine.info.labels) != 1:
        raise BadInput(f"rerank needs a 1-label score head; this model has "
                       f"{len(state.engine.info.labels)} labels (use /classify)", "model")
    if not docs:
        raise BadInput("documents is empty", "documents")
    cut = body.truncation_direction.lower() if body.truncate else body.truncate_prompt_tokens
    prompts = await tokenized(state, request, body.model, pair_ids, state, body.query, docs,
                              per_doc, cut)
    results = await run_prompts(state, request, prompts, SamplingParams(head=True),
                                shared_len(state, prompts))
    tokens = sum(r.prompt_tokens for r in results)
    state.metrics.on_task(task, len(results), tokens)
    activation = body.use_activation is not False and not body.raw_scores
    return head_scores(state, results, activation)[:, 0].tolist(), tokens


def ranked(vals: list[float], top_n: int | None) -> list[int]:
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    return order[:top_n] if top_n else order


async def answer(state: AppState, body: dict[str, Any] | list, items: int) -> Response:
    response = await json_answer(items, lambda: body)
    state.metrics.count("ok")
    return response


@router.post("/rerank")
@router.post("/v1/rerank")
async def rerank(body: RerankRequest, state: State, request: Request) -> Response:
    """vLLM's and Jina's shape (results sorted by relevance_score, cut to top_n), or TEI's."""
    if (body.documents is None) == (body.texts is None):
        raise BadInput("send `documents` (vLLM, Jina) or `texts` (TEI), not both nor neither",
                       "documents")
    if body.texts is not None:
        vals, _ = await scores(state, request, body, body.texts, None)
        return await answer(state, [{"index": i, "score": vals[i], **(
            {"text": body.texts[i]} if body.return_text else {})} for i in ranked(vals, None)],
                            len(vals))
    docs = texts(body.documents)
    vals, tokens = await scores(state, request, body, docs, body.max_tokens_per_doc)
    results = [{"index": i, "relevance_score": vals[i],
                **({"document": {"text": docs[i]}} if body.return_documents else {})}
               for i in ranked(vals, body.top_n)]
    return await answer(state, {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name,
                                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                "results": results}, len(results))


@router.post("/v2/rerank")
async def rerank_v2(body: RerankRequest, state: State, request: Request) -> Response:
    """Cohere's v2 shape; each document is cut to max_tokens_per_doc (4096 unset)."""
    if body.documents is None:
        raise BadInput("documents is required", "documents")
    vals, tokens = await scores(state, request, body, texts(body.documents),
                                body.max_tokens_per_doc or COHERE_DOC_TOKENS)
    results = [{"index": i, "relevance_score": vals[i]} for i in ranked(vals, body.top_n)]
    meta = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": tokens}}
    return await answer(state, {"id": str(uuid.uuid4()), "results": results, "meta": meta},
                        len(results))
