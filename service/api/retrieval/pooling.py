"""vLLM's POST /pooling: the pooled vector (task embed) or the score head's scores (classify)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.prompts import run_prompts, tokenized
from service.api.retrieval import embeddings as emb
from service.api.retrieval.classify import NO_HEAD, head_scores, last_not_pad
from service.api.state import AppState
from service.engine.interface import SamplingParams

router = api_router("retrieval", prefix="")
TASKS = ("embed", "classify", "token_embed", "token_classify", "plugin")


class PoolingRequest(emb.EmbeddingRequest):
    task: Literal[TASKS] | None = Field(None, description=(
        "embed or classify; unset: embed where the model pools, else classify."))
    use_activation: bool | None = Field(None, description=(
        "classify: false gives raw logits; else softmax over 2+ labels, sigmoid of 1."))


def task_of(state: AppState, body: PoolingRequest) -> str:
    info = state.engine.info
    task = body.task or ("embed" if info.pooling or not info.head else "classify")
    if task not in ("embed", "classify"):
        raise BadInput(f"task {task!r} is not served: embed (POOLING) or classify (a score "
                       "head)", "task")
    if task == "embed":
        emb.require_pooling(state)
        emb.check_dimensions(state, body.dimensions)
    elif not info.head:
        raise BadInput(NO_HEAD, "task")
    elif body.dimensions is not None:
        raise BadInput("dimensions applies to task embed only", "dimensions")
    return task


async def classified(state: AppState, request: Request, prompts: list[list[int]],
                     activation: bool) -> tuple[np.ndarray, int]:
    results = await run_prompts(state, request, last_not_pad(state, prompts),
                                SamplingParams(head=True))
    tokens = sum(r.prompt_tokens for r in results)
    state.metrics.on_task("classify", len(results), tokens)
    return head_scores(state, results, activation).astype("<f4"), tokens


@router.post("/pooling")
async def pooling(body: PoolingRequest, state: State, request: Request) -> Response:
    """Each input's pooled vector (embed) or its score head's probabilities (classify)."""
    task = task_of(state, body)
    prompts = await tokenized(state, request, body.model, emb.input_ids, state, body)
    if task == "embed":
        vecs, tokens = await emb.embed_prompts(state, request, prompts, body.dimensions)
    else:
        vecs, tokens = await classified(state, request, prompts, body.use_activation is not False)
    b64 = body.encoding_format == "base64"
    response = await json_answer(vecs.size, lambda: {
        "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "data": [{"index": i, "object": "pooling", "data": base64.b64encode(v.tobytes()).decode()
                  if b64 else v.tolist()} for i, v in enumerate(vecs)]})
    state.metrics.count("ok")
    return response
