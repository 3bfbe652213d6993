"""TEI's POST /predict: every label's score per input (a text or a pair), sorted by score."""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.prompts import check_ids, tokenized
from service.api.retrieval.classify import require_head
from service.api.retrieval.pooling import classified
from service.api.schemas import Body, Text
from service.api.state import AppState

router = api_router("retrieval", prefix="")


class PredictRequest(Body):
    inputs: Text | list[Text | list[Text]] = Field(description=(
        "A text, a pair [a, b], or a list of texts and pairs (TEI: two strings are one pair)."))
    raw_scores: bool = False
    truncate: bool | None = Field(False, description=(
        "Cut an over-long input to the longest prompt served; unset or false: it is a 400."))
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"


def sequences(inputs: str | list) -> tuple[list[list[str]], bool]:
    """Each input as [text] or [a, b], and whether the body held one input (TEI's untagged enum)."""
    if isinstance(inputs, str):
        return [[inputs]], True
    if len(inputs) == 2 and all(isinstance(x, str) for x in inputs):
        return [list(inputs)], True
    if not inputs:
        raise BadInput("inputs is empty", "inputs")
    out = [[x] if isinstance(x, str) else x for x in inputs]
    bad = next((i for i, x in enumerate(out) if len(x) not in (1, 2)), None)
    if bad is not None:
        raise BadInput(f"inputs[{bad}] must be a text or a pair [a, b]", "inputs")
    return out, False


def predict_ids(state: AppState, seqs: list[list[str]], body: PredictRequest) -> list[list[int]]:
    """A text with the post-processor's special tokens, a pair with its pair template."""
    tok, limit = state.tokenizer, state.max_prompt_tokens
    head, tail = tok.special_ends()
    left = body.truncation_direction.lower() == "left"
    ids = []
    for s in seqs:
        got = tok.encode_pair(*s) if len(s) == 2 else tok.encode_all(s[0], False).tolist()
        keep = limit if len(s) == 2 else max(limit - len(head) - len(tail), 1)
        if body.truncate:
            got = got[-keep:] if left else got[:keep]
        ids.append(got if len(s) == 2 else head + got + tail)
    return check_ids(state, ids, "inputs", False)


@router.post("/predict")
async def predict(body: PredictRequest, state: State, request: Request) -> Response:
    """TEI's answer: a list of {score, label} per input, or a list of lists for a batch."""
    require_head(state)
    seqs, single = sequences(body.inputs)
    prompts = await tokenized(state, request, None, predict_ids, state, seqs, body)
    probs, _ = await classified(state, request, prompts, not body.raw_scores)
    labels = state.engine.info.labels
    out = [sorted(({"score": float(s), "label": labels[j]} for j, s in enumerate(row)),
                  key=lambda d: -d["score"]) for row in probs]
    response = await json_answer(probs.size, lambda: out[0] if single else out)
    state.metrics.count("ok")
    return response
