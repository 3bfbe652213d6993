"""vLLM's tokenizer routes: POST /tokenize and /detokenize, GET /tokenizer_info, at the root
(where lm-eval's remote tokenizer calls them) and under /v1/. They use the API worker's own
tokenizer, never the engine; they answer once the engine has reported the model's limits."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.chat_template import generation_prompt, render
from service.api.deps import State, json_response, require_api_key
from service.api.prompts import check_model, check_vocab, off_loop
from service.api.schemas_tokenizer import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from service.api.state import AppState
from service.engine.interface import NotReady
from service.model.tokenizer_export import tokenizer_config

router = APIRouter(tags=["tokenizer"], dependencies=[Depends(require_api_key)])


def max_model_len(state: AppState) -> int:
    """The longest prompt this server takes (MAX_PROMPT_TOKENS, the model's context, the KV
    pool), known once the engine has loaded the model."""
    if state.engine.info is None:
        raise NotReady(f"engine is {state.engine.state}: the model's limits are not known yet")
    return state.max_prompt_tokens


def _tokenize(state: AppState, body: TokenizeRequest, limit: int) -> TokenizeResponse:
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
    ids = state.tokenizer.encode(text, add_special)
    strs = [state.tokenizer.token_str(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=limit, tokens=ids, token_strs=strs)


def _detokenize(state: AppState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_vocab(body.tokens, state.tokenizer.vocab_size, "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


async def tokenize(body: TokenizeRequest, state: State, request: Request) -> Response:
    """Token ids of `prompt` (with the BOS the model's tokenizer adds, unless
    add_special_tokens is false) or of `messages` rendered with the model's chat template,
    their count, and the longest prompt served."""
    check_model(state, body.model)
    limit = max_model_len(state)
    return json_response(await off_loop(request, _tokenize, state, body, limit))


async def detokenize(body: DetokenizeRequest, state: State, request: Request) -> Response:
    """The text of `tokens` (special tokens included)."""
    check_model(state, body.model)
    return json_response(await off_loop(request, _detokenize, state, body))


async def tokenizer_info(state: State) -> Response:
    """The tokenizer's config: bos/eos/pad tokens, add_bos_token, model_max_length (the
    longest prompt served), chat_template, tokenizer_class."""
    config = tokenizer_config(state.tokenizer, max_model_len(state))
    return json_response(TokenizerInfoResponse(**config))


for _prefix in ("", "/v1"):
    router.add_api_route(f"{_prefix}/tokenize", tokenize, methods=["POST"],
                         response_model=TokenizeResponse)
    router.add_api_route(f"{_prefix}/detokenize", detokenize, methods=["POST"],
                         response_model=DetokenizeResponse)
    router.add_api_route(f"{_prefix}/tokenizer_info", tokenizer_info, methods=["GET"],
                         response_model=TokenizerInfoResponse)
