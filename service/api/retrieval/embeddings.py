"""POST /v1/embeddings: OpenAI's shape as vLLM serves it, pooled in the engine's forward."""

from __future__ import annotations

import base64
import functools
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from service.api.deps import State, api_router, json_answer
from service.api.errors import BadInput
from service.api.openai.chat_template import render
from service.api.openai.schemas import ChatMessage
from service.api.prompts import check_ids, encode_texts, run_prompts, tokenized
from service.api.schemas import Body, ModelName, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import MAX_INT32, PromptResult, SamplingParams
from service.model.pooling import Pooling, from_checkpoint

router = api_router("retrieval")


class EmbeddingRequest(Body):
    model: ModelName = None
    input: Text | list[Text] | TokenIds | list[TokenIds] | None = Field(None, description=(
        "A text, texts, one prompt's token ids, or several prompts' token ids."))
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = Field(None, description=(
        "The chat form instead of input: a conversation, or several (as MTEB sends), each "
        "rendered with the chat template."))
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Keep the first n values, then "
                                   "normalize (Matryoshka).")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32, description=(
        "Keep only each input's last k tokens; -1: the longest prompt served. Unset: an "
        "over-long input is a 400."))
    add_special_tokens: bool | None = Field(None, description=(
        "Default true for input, false for messages (the chat template writes its own)."))


@functools.lru_cache(maxsize=4)
def checkpoint(model_path: str) -> Pooling:
    return from_checkpoint(Path(model_path))


def with_default_prompt(state: AppState, inp: str | list[str]) -> str | list[str]:
    """The checkpoint's default_prompt_name prompt prepended, as SentenceTransformer.encode does."""
    ckpt = checkpoint(state.engine.info.model_path)
    prompt = ckpt.prompts.get(ckpt.default_prompt_name or "", "")
    if not prompt:
        return inp
    return prompt + inp if isinstance(inp, str) else [prompt + t for t in inp]


def check_dimensions(state: AppState, dims: int | None) -> None:
    """vLLM's gate: `dimensions` only where config.json (or MATRYOSHKA) declares Matryoshka."""
    ckpt = checkpoint(state.engine.info.model_path)
    listed, mrl = ckpt.matryoshka_dims, state.engine_cfg.matryoshka
    if mrl is None:
        mrl = ckpt.matryoshka
    if dims is None or mrl and (listed is None or dims in listed):
        return
    why = (f"is not one of the model's matryoshka_dimensions {list(listed)}" if mrl
           else "needs a Matryoshka model (config.json is_matryoshka or matryoshka_dimensions, "
           "or MATRYOSHKA=true); leave dimensions unset")
    raise BadInput(f"dimensions={dims} {why}", "dimensions")


def input_ids(state: AppState, body: EmbeddingRequest) -> list[list[int]]:
    inp, cut = body.input, body.truncate_prompt_tokens
    if cut == 0:
        raise BadInput("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    if (inp is None) == (body.messages is None):
        raise BadInput("give exactly one of input (texts or token ids) or messages (a chat)",
                       "input")
    if body.messages is not None:
        return chat_ids(state, body)
    if isinstance(inp, str) or inp and isinstance(inp[0], str):
        inp = with_default_prompt(state, inp)
        specials = body.add_special_tokens is not False
        return with_specials(state, inp, cut) if specials else encode_texts(
            state, [inp] if isinstance(inp, str) else inp, "input", isinstance(inp, str),
            False, cut)
    if not inp:
        raise BadInput("input is empty", "input")
    if isinstance(inp[0], int):
        return check_ids(state, [inp], "input", True, cut)
    return check_ids(state, inp, "input", False, cut)


def chat_ids(state: AppState, body: EmbeddingRequest) -> list[list[int]]:
    """vLLM's EmbeddingChatRequest: each conversation rendered without a generation prompt."""
    if not body.messages:
        raise BadInput("messages is empty", "messages")
    single = not isinstance(body.messages[0], list)
    chats = [body.messages] if single else body.messages
    texts = [render(state.tokenizer, chat, add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=False, chat_template_kwargs=body.chat_template_kwargs)
             for chat in chats]
    cut = body.truncate_prompt_tokens
    if body.add_special_tokens:
        return with_specials(state, texts[0] if single else texts, cut, "messages")
    return check_ids(state, encode_texts(state, texts, "messages", single, False, cut),
                     "messages", single)


def with_specials(state: AppState, inp: str | list[str], cut: int | None,
                  field: str = "input") -> list[list[int]]:
    """Texts tokenized with the post-processor's special tokens, as sentence-transformers does;
    truncation keeps the last tokens, these included."""
    head, tail = state.tokenizer.special_ends()
    extra, single = len(head) + len(tail), isinstance(inp, str)
    keep = None if cut is None else max((state.max_prompt_tokens if cut == -1 else cut) - extra, 1)
    ids = encode_texts(state, [inp] if single else inp, field, single, False, keep)
    return check_ids(state, [head + p + tail for p in ids], field, single)


def vectors(results: list[PromptResult], dims: int | None, normalize: bool) -> np.ndarray:
    """(n, d) float32: truncated to `dims`, then L2-normalized, as vLLM and TEI do."""
    out = np.stack([np.frombuffer(r.embedding, dtype="<f4") for r in results])[:, :dims]
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype("<f4")


def to_response(state: AppState, vecs: np.ndarray, fmt: str, tokens: int) -> dict:
    data = [{"index": i, "object": "embedding",
             "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64"
             else v.tolist()} for i, v in enumerate(vecs)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def require_pooling(state: AppState) -> None:
    info = state.engine.info
    if info is not None and not info.pooling:
        raise BadInput("this model has no pooling: set POOLING=last, mean or cls (or serve a "
                       "sentence-transformers checkpoint) to serve embeddings", "model")


async def embed_prompts(state: AppState, request: Request, prompts: list[list[int]],
                        dims: int | None, normalize: bool | None = None) -> tuple[np.ndarray, int]:
    """The prompts' pooled vectors (normalized as the model says unless `normalize` is set) and
    their token count; counted in the embed task metrics."""
    info = state.engine.info
    results = await run_prompts(state, request, prompts, SamplingParams(pool=info.pooling))
    width = len(results[0].embedding) // 4
    if dims is not None and dims > width:
        raise BadInput(f"dimensions={dims}: the model's embeddings have {width}", "dimensions")
    vecs = vectors(results, dims, info.normalize if normalize is None else normalize)
    tokens = sum(r.prompt_tokens for r in results)
    state.metrics.on_task("embed", len(results), tokens)
    return vecs, tokens


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, state: State, request: Request) -> Response:
    """Each input's pooled final-norm hidden state (POOLING), normalized as the model says."""
    require_pooling(state)
    check_dimensions(state, body.dimensions)
    prompts = await tokenized(state, request, body.model, input_ids, state, body)
    vecs, tokens = await embed_prompts(state, request, prompts, body.dimensions)
    response = await json_answer(vecs.size, lambda: to_response(
        state, vecs, body.encoding_format, tokens))
    state.metrics.count("ok")
    return response
