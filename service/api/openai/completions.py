"""POST /v1/completions: the OpenAI legacy completions API, limited to max_tokens 0 or 1.

max_tokens=0, echo=true, logprobs=k gives prompt logprobs; temperature defaults to 0 here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.api.deps import State, api_router, json_answer, logprob_count
from service.api.errors import BadInput
from service.api.openai.choices import PREFILL_ONLY, outcome, prompt_logprobs_by_id, token_namer
from service.api.openai.schemas import CompletionUsage, PromptLogprob
from service.api.prompts import (
    check_ids,
    encode_texts,
    named_ids,
    one_remote_decode,
    run_prompts,
    sampling_params,
    tokenized,
)
from service.api.schemas import ModelName, PromptTokensDetails, Sampling, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import (
    MAX_INT32,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PositionLogprobs,
    PromptResult,
)

router = api_router("completions")


class CompletionRequest(Sampling):
    """The OpenAI legacy completions request, limited to what one prefill can answer."""

    model: ModelName = None
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32,
                                   description="0 or 1 (default 1) in this service.")
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT32,
                                              description="max_tokens when that is unset.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "vLLM's: per choice, each prompt token's logprob and rank with this many alternatives, "
        "keyed by token id."))
    return_token_ids: bool = False
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    logprob_token_ids: TokenIds | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "An extension (vLLM's name): with logprobs set, each position's top_logprobs lists "
            "these tokens, whatever their rank, instead of the most likely ones."))
    echo: bool = False
    n: int = Field(1, ge=1, le=MAX_INT32)
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)
    stream: bool = False
    stream_options: dict | None = None
    stop: Text | list[Text] | None = None
    suffix: Text | None = None
    user: Text | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["length", "stop"]
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    kv_transfer_params: dict[str, Any] | None = None  # for the decode (KV_TRANSFER)


def check_supported(body: CompletionRequest) -> int:
    """Refuse what needs decoding or cannot be honoured; return max_tokens (0 or 1)."""
    max_tokens = next((m for m in (body.max_tokens, body.max_completion_tokens)
                       if m is not None), 1)
    if max_tokens > 1:
        raise BadInput(f"max_tokens={max_tokens}: {PREFILL_ONLY} (use max_tokens 0 or 1)",
                       "max_tokens")
    if body.stream:
        raise BadInput(f"stream=true: {PREFILL_ONLY}; use stream=false", "stream")
    if body.n != 1:
        raise BadInput(f"n={body.n}: {PREFILL_ONLY}; only n=1 is supported", "n")
    if body.best_of not in (None, 1):
        raise BadInput(f"best_of={body.best_of}: {PREFILL_ONLY}; only best_of=1", "best_of")
    if body.suffix:
        raise BadInput("suffix (insertion) is not supported by this service", "suffix")
    if body.logprob_token_ids and body.logprobs is None:
        raise BadInput("logprob_token_ids needs logprobs (the logprobs are returned there)",
                       "logprob_token_ids")
    return max_tokens


def prompt_inputs(state: AppState, body: CompletionRequest
                  ) -> tuple[list[list[int]], list[str | None]]:
    """Token ids per prompt, and the prompt text when it was given as text."""
    prompt, cut, special = body.prompt, body.truncate_prompt_tokens, body.add_special_tokens
    if isinstance(prompt, str):
        return encode_texts(state, [prompt], "prompt", True, special, cut), [prompt]
    assert isinstance(prompt, list)
    if not prompt:
        raise BadInput("prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return encode_texts(state, prompt, "prompt", False, special, cut), list(prompt)
    if isinstance(prompt[0], int):
        return check_ids(state, [prompt], "prompt", True, cut), [None]
    return check_ids(state, prompt, "prompt", False, cut), [None] * len(prompt)


def _top(name: Callable[[int], str], p: PositionLogprobs, named: tuple[int, ...], k: int
         ) -> dict[str, float]:
    top = ({name(t.id): t.logprob for t in p.top[:k]} if p.named is None
           else {name(t): v for t, v in zip(named, p.named)})
    top.setdefault(name(p.token.id), p.token.logprob)  # vLLM: the chosen token is always listed
    return top


def to_choice(state: AppState, i: int, body: CompletionRequest, max_tokens: int, ids: list[int],
              prompt_text: str, res: PromptResult) -> CompletionChoice:
    tok = state.tokenizer
    gen = res.next.token.id if max_tokens == 1 else None
    gen_text, finish, stop_reason = outcome(tok, body, gen)
    text = (prompt_text if body.echo else "") + gen_text
    named = tuple(body.logprob_token_ids or ())
    logprobs = None
    if body.logprobs is not None:
        name = token_namer(tok, body.return_tokens_as_token_ids)
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        offset = 0 if body.echo else len(prompt_text)

        def add(token: int, logprob: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            lp.tokens.append(name(token))
            lp.token_logprobs.append(logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(tok.token_text(token))

        k = body.logprobs
        if body.echo:
            add(ids[0], None, None)
            for p in res.prompt_logprobs or []:
                add(p.token.id, p.token.logprob, _top(name, p, named, k))
        if gen is not None:
            add(gen, res.next.token.logprob, _top(name, res.next, named, k))
        logprobs = lp
    plps = (prompt_logprobs_by_id(state, ids, res, body.prompt_logprobs, named)
            if body.prompt_logprobs is not None else None)
    return CompletionChoice(
        index=i, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason,
        prompt_logprobs=plps, prompt_token_ids=ids if body.return_token_ids else None,
        token_ids=([] if gen is None else [gen]) if body.return_token_ids else None)


@router.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, state: State,
                      request: Request) -> Response:
    max_tokens = check_supported(body)
    prompts, texts = await tokenized(state, request, body.model, prompt_inputs, state, body)
    want_lps = body.logprobs is not None
    named = named_ids(state, body.logprob_token_ids)
    k = max(body.logprobs or 0, body.prompt_logprobs or 0)
    params = sampling_params(state, body, top_logprobs=0 if named else k,
                             prompt_logprobs=(want_lps and body.echo)
                             or body.prompt_logprobs is not None,
                             logprob_token_ids=named)
    one_remote_decode(params, prompts)
    results = await run_prompts(state, request, prompts, params)
    n_prompt = sum(r.prompt_tokens for r in results)
    n_gen = max_tokens * len(results)

    def answer() -> CompletionResponse:  # echo with logprobs: megabytes, built off the loop
        decode = state.tokenizer.decode
        choices = [to_choice(state, i, body, max_tokens, ids,
                             text if text is not None else decode(ids), res)
                   for i, (ids, text, res) in enumerate(zip(prompts, texts, results))]
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name,
            choices=choices, kv_transfer_params=results[0].kv_transfer,
            usage=CompletionUsage(
                prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen,
                prompt_tokens_details=PromptTokensDetails(
                    cached_tokens=sum(r.cached_tokens for r in results))))

    response = await json_answer(logprob_count(results, params), answer)
    state.metrics.count("ok")
    return response
