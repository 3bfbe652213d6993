"""TEI's POST /embed (and POST / for an embedding model): a bare JSON array of vectors."""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.prompts import check_ids, tokenized
from service.api.retrieval import embeddings as emb
from service.api.schemas import Body, Text
from service.api.state import AppState

router = api_router("retrieval", prefix="")


class EmbedRequest(Body):
    inputs: Text | list[Text] = Field(description="A text or texts.")
    normalize: bool = True
    truncate: bool | None = Field(False, description=(
        "Cut an over-long input to the longest prompt served; unset or false: it is a 400."))
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    prompt_name: str | None = Field(None, description=(
        "A key of the checkpoint's config_sentence_transformers.json prompts: prepended."))
    dimensions: int | None = Field(None, ge=1, description="Keep the first n values, then "
                                   "normalize (Matryoshka).")


def embed_ids(state: AppState, body: EmbedRequest) -> list[list[int]]:
    single = isinstance(body.inputs, str)
    texts = [body.inputs] if single else body.inputs
    if not texts:
        raise BadInput("inputs is empty", "inputs")
    if body.prompt_name is None:
        texts = emb.with_default_prompt(state, texts)
    else:
        prompts = emb.checkpoint(state.engine.info.model_path).prompts
        if body.prompt_name not in prompts:
            raise BadInput(f"prompt_name {body.prompt_name!r} is not one of the model's prompts "
                           f"{sorted(prompts)}", "prompt_name")
        texts = [prompts[body.prompt_name] + t for t in texts]
    if not body.truncate:
        return emb.with_specials(state, texts[0] if single else texts, None, "inputs")
    head, tail = state.tokenizer.special_ends()
    keep = max(state.max_prompt_tokens - len(head) - len(tail), 1)
    left = body.truncation_direction.lower() == "left"
    ids = []
    for i, text in enumerate(texts):
        if not text:
            raise BadInput(f"inputs[{i}] is empty" if not single else "inputs is empty", "inputs")
        got = state.tokenizer.encode_all(text, False).tolist()
        ids.append(head + (got[-keep:] if left else got[:keep]) + tail)
    return check_ids(state, ids, "inputs", single)


@router.post("/embed")
async def embed(body: EmbedRequest, state: State, request: Request) -> Response:
    """Each input's pooled vector, normalized unless `normalize` is false (TEI's default: true)."""
    emb.require_pooling(state)
    prompts = await tokenized(state, request, None, embed_ids, state, body)
    vecs, _ = await emb.embed_prompts(state, request, prompts, body.dimensions, body.normalize)
    response = await json_answer(vecs.size, vecs.tolist)
    state.metrics.count("ok")
    return response


# huggingface_hub's InferenceClient(base_url=...) posts to the base URL itself, as TEI serves it
router.add_api_route("/", embed, methods=["POST"], include_in_schema=False)
