"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info), at the root (lm-eval calls
them there) and under /v1/: the worker's own tokenizer, once the engine has reported the model's
limits; every token returned, as vLLM does, long texts and answers a piece at a time."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from service.api.bodies import parse_body
from service.api.deps import (
    JSON_PIECE,
    State,
    api_router,
    json_array,
    json_ids,
    json_response,
    parts_response,
)
from service.api.errors import BadInput
from service.api.openai.chat_template import generation_prompt, render
from service.api.openai.schemas import ChatMessage
from service.api.prompts import check_model, check_vocab, off_loop
from service.api.schemas import Body, ModelName, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import NotReady
from service.model.text_pieces import RunTooLong
from service.model.tokenizer_export import tokenizer_config

router = api_router("tokenizer", prefix="")

# fields of the chat form only (vLLM's TokenizeChatRequest)
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
               "tools")


class TokenizeRequest(Body):
    """One of `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (TokenizeChatRequest)."""

    model: ModelName = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, description=(
        "A chat, rendered with the model's own chat template, then tokenized."))
    add_special_tokens: bool | None = Field(None, description=(
        "Add the special tokens the model's tokenizer adds (a BOS, when it adds one). Default: "
        "true for prompt, false for messages (the chat template writes its own)."))
    return_token_strs: bool | None = Field(False, description=(
        "Also return each token's vocabulary entry (`token_strs`)."))
    add_generation_prompt: bool | None = Field(None, description=(
        "Default: true, false with continue_final_message."))
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "Extra variables for the chat template."))
    tools: list[dict[str, Any]] | None = Field(None, description="Given to the template.")

    @field_validator(*CHAT_FIELDS)
    @classmethod
    def _chat_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("prompt") is not None:  # prompt is validated first
            raise ValueError("applies to messages (the chat form); this request has prompt")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) or messages (a chat)"
                             + (" (got both)" if self.prompt is not None else ""))
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the longest prompt this server takes
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Body):
    model: ModelName = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's tokenizer_config.json, as `python -m service.tokenizer export` writes it."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    model_max_length: int
    clean_up_tokenization_spaces: bool = False
    chat_template: str | None = None


def max_model_len(state: AppState) -> int:
    """The longest prompt served, known once the engine has loaded the model."""
    if state.engine.info is None:
        raise NotReady(f"engine is {state.engine.state}: the model's limits are not known yet")
    return state.max_prompt_tokens


# A /detokenize answer is at most this many times MAX_BODY_BYTES (its text's JSON)
TEXT_PER_BODY_BYTE = 8
_encoder = msgspec.json.Encoder()
_DETOKENIZE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": DetokenizeRequest.model_json_schema()}}}}


def _tokenize(state: AppState, body: TokenizeRequest, limit: int) -> bytes:
    if body.messages is not None:
        text = render(state.tokenizer, body.messages,
                      add_generation_prompt=generation_prompt(body.add_generation_prompt,
                                                              body.continue_final_message),
                      continue_final_message=body.continue_final_message,
                      chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
        add_special = bool(body.add_special_tokens)  # the template writes its own
    else:
        text = body.prompt
        add_special = body.add_special_tokens is not False
    try:
        ids = state.tokenizer.encode_all(text, add_special)
    except RunTooLong as e:
        field = "prompt" if body.messages is None else "messages"
        raise BadInput(f"{field}: {e}", field) from None
    strs = None
    if body.return_token_strs:
        strs = json_array(itertools.chain.from_iterable(
            map(state.tokenizer.token_str, ids[i:i + JSON_PIECE].tolist())
            for i in range(0, len(ids), JSON_PIECE)))
    return _encoder.encode({"count": len(ids), "max_model_len": limit, "tokens": json_ids(ids),
                            "token_strs": strs})


def _detokenize(state: AppState, raw: bytes) -> list[bytes]:
    body, ids = parse_body(raw, DetokenizeRequest, "tokens")
    check_model(state, body.model)
    check_vocab(ids, state.tokenizer.vocab_size, "tokens")
    most = TEXT_PER_BODY_BYTE * state.server_cfg.max_body_bytes
    parts, size = [], 0
    for text in state.tokenizer.decode_pieces(ids):
        parts.append(_encoder.encode(text)[1:-1])
        size += len(parts[-1])
        if size > most:
            raise BadInput(f"the text of these tokens is more than {most} bytes (the limit: "
                           f"{TEXT_PER_BODY_BYTE} x MAX_BODY_BYTES)", "tokens")
    return [b'{"prompt":"', *parts, b'"}']


async def tokenize(body: TokenizeRequest, state: State, request: Request) -> Response:
    """Token ids of `prompt` (with the BOS the model's tokenizer adds, unless
    add_special_tokens is false) or of `messages` rendered with the model's chat template,
    their count, and the longest prompt served."""
    check_model(state, body.model)
    limit = max_model_len(state)
    return Response(await off_loop(state, request, _tokenize, state, body, limit),
                    media_type="application/json")


async def detokenize(state: State, request: Request) -> Response:
    """The text of `tokens` (special tokens included); the body is a DetokenizeRequest."""
    raw = await request.body()
    return parts_response(await off_loop(state, request, _detokenize, state, raw))


async def tokenizer_info(state: State) -> Response:
    """The tokenizer's config: bos/eos/pad tokens, add_bos_token, model_max_length (the
    longest prompt served), chat_template, tokenizer_class."""
    config = tokenizer_config(state.tokenizer, max_model_len(state))
    return json_response(TokenizerInfoResponse(**config))


for _prefix in ("", "/v1"):
    router.add_api_route(f"{_prefix}/tokenize", tokenize, methods=["POST"],
                         response_model=TokenizeResponse)
    router.add_api_route(f"{_prefix}/detokenize", detokenize, methods=["POST"],
                         response_model=DetokenizeResponse, openapi_extra=_DETOKENIZE_BODY)
    router.add_api_route(f"{_prefix}/tokenizer_info", tokenizer_info, methods=["GET"],
                         response_model=TokenizerInfoResponse)
