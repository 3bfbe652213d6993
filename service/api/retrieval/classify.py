"""POST /classify: vLLM's shape, the score head's logits of each input's last token."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.prompts import run_prompts, tokenized
from service.api.retrieval.embeddings import with_specials
from service.api.schemas import Body, ModelName, Text
from service.api.state import AppState
from service.engine.interface import MAX_INT32, PromptResult, SamplingParams

router = api_router("retrieval", prefix="")
NO_HEAD = ("this model has no score head: serve a *ForSequenceClassification checkpoint, or set "
           "SCORE_HEAD=yes-no for a yes/no reranker (Qwen3-Reranker)")


class ClassifyRequest(Body):
    model: ModelName = None
    input: Text | list[Text] = Field(description="A text or texts.")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32, description=(
        "Keep only each input's last k tokens; -1: the longest prompt served. Unset: an "
        "over-long input is a 400."))
    use_activation: bool | None = Field(None, description=(
        "false: raw logits; else softmax over 2+ labels, sigmoid of 1 (vLLM's rule)."))
    user: str | None = None


def require_head(state: AppState) -> None:
    info = state.engine.info
    if info is not None and not info.head:
        raise BadInput(NO_HEAD, "model")


def last_not_pad(state: AppState, prompts: list[list[int]]) -> list[list[int]]:
    """Trailing pad ids go, as transformers' classifier reads the last token that is not pad."""
    pad, out = state.engine.info.pad_id, []
    for ids in prompts:
        n = len(ids)
        while n > 1 and ids[n - 1] == pad:
            n -= 1
        out.append(ids[:n])
    return out


def scored_ids(state: AppState, inp: str | list[str], cut: int | None) -> list[list[int]]:
    return last_not_pad(state, with_specials(state, inp, cut))


def head_scores(state: AppState, results: list[PromptResult], activation: bool) -> np.ndarray:
    """(n, labels) float64: raw logits, or the head's activation (vLLM's for its problem_type)."""
    raw = np.stack([np.frombuffer(r.scores, dtype="<f4") for r in results]).astype(np.float64)
    kind = state.engine.info.activation
    if not activation or kind == "identity":
        return raw
    if raw.shape[1] == 1 or kind == "sigmoid":
        return 1.0 / (1.0 + np.exp(-raw))
    e = np.exp(raw - raw.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@router.post("/classify")
async def classify(body: ClassifyRequest, state: State, request: Request) -> Response:
    """Each input's class probabilities from the model's score head (SCORE_HEAD)."""
    require_head(state)
    if body.truncate_prompt_tokens == 0:
        raise BadInput("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    if not body.input:
        raise BadInput("input is empty", "input")
    prompts = await tokenized(state, request, body.model, scored_ids, state, body.input,
                              body.truncate_prompt_tokens)
    results = await run_prompts(state, request, prompts, SamplingParams(head=True))
    probs = head_scores(state, results, body.use_activation is not False)
    labels = state.engine.info.labels
    tokens = sum(r.prompt_tokens for r in results)
    data = [{"index": i, "label": labels[int(np.argmax(p))], "probs": p.tolist(),
             "num_classes": len(p)} for i, p in enumerate(probs)]
    response = await json_answer(probs.size, lambda: {
        "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": state.model_name, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    state.metrics.on_task("classify", len(results), tokens)
    state.metrics.count("ok")
    return response
