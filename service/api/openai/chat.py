"""POST /v1/chat/completions: OpenAI's chat API with vLLM's extras, max_tokens 0 or 1; messages
rendered by the model's chat template, tokenized without an added BOS (vLLM's default for chat)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.api.deps import State, api_router, json_answer, logprob_count
from service.api.errors import BadInput
from service.api.openai.chat_template import generation_prompt, render, texts
from service.api.openai.choices import PREFILL_ONLY, outcome, prompt_logprobs_by_id, token_namer
from service.api.openai.schemas import ChatMessage, CompletionUsage, PromptLogprob
from service.api.prompts import encode_texts, named_ids, run_prompts, sampling_params, tokenized
from service.api.schemas import ModelName, PromptTokensDetails, Sampling, Text, TokenIds
from service.api.state import AppState
from service.engine.interface import (
    MAX_INT32,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PositionLogprobs,
    PromptResult,
)
from service.text import clip

router = api_router("chat")


class ChatCompletionRequest(Sampling):
    """OpenAI's chat completions request with vLLM's extra fields; max_tokens 0 or 1."""

    model: ModelName = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32,
                                   description="0 or 1 (default 1) in this service.")
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT32,
                                              description="Takes precedence over max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_token_ids: TokenIds | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "vLLM's: with logprobs, top_logprobs lists these tokens (and the chosen one), "
            "whatever their rank."))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "vLLM's: each prompt token's logprob and rank with this many alternatives, keyed by "
        "token id, in the response's prompt_logprobs (echo sets it to top_logprobs)."))
    n: int = Field(1, ge=1, le=MAX_INT32)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: Text | list[Text] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Given to the template.")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = Field(None, description="Given to the template.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Given to the template, with enable_thinking (vLLM).")
    add_generation_prompt: bool | None = Field(None, description=(
        "Default: true, false with continue_final_message."))
    continue_final_message: bool = False
    add_special_tokens: bool = Field(False, description=(
        "Add the tokenizer's BOS on top of what the template writes (vLLM's default: false)."))
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "More template variables (enable_thinking, ...)."))
    echo: bool = Field(False, description=(
        "vLLM's: the reply starts with the last message's content when that message has the "
        "reply's role; prompt_logprobs defaults to top_logprobs."))
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool | None = False
    return_token_ids: bool | None = False
    user: Text | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobsContent(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobsContent] | None


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["length", "stop"]
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # for the decode (KV_TRANSFER)

MIN_LOGPROB = -9999.0  # vLLM's floor for a reported logprob (-inf is not JSON)


def check_supported(body: ChatCompletionRequest) -> int:
    """Refuse what needs decoding or cannot be honoured; return max_tokens (0 or 1)."""
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, field)
    max_tokens = 1 if max_tokens is None else max_tokens
    if max_tokens > 1:
        raise BadInput(f"{field}={max_tokens}: {PREFILL_ONLY} (use {field} 0 or 1)", field)
    if body.stream:
        raise BadInput(f"stream=true: {PREFILL_ONLY}; use stream=false", "stream")
    if body.n != 1:
        raise BadInput(f"n={body.n}: {PREFILL_ONLY}; only n=1 is supported", "n")
    if body.tool_choice == "required" or isinstance(body.tool_choice, dict):
        raise BadInput(f"tool_choice={clip(str(body.tool_choice))}: forcing a tool call needs "
                       "constrained decoding, which this service does not do; use \"auto\" or "
                       "\"none\"", "tool_choice")
    if body.top_logprobs and not body.logprobs:
        raise BadInput("top_logprobs needs logprobs=true", "top_logprobs")
    if body.logprob_token_ids and not body.logprobs:
        raise BadInput("logprob_token_ids needs logprobs=true (the logprobs are returned there)",
                       "logprob_token_ids")
    return max_tokens


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, after vLLM's reasoning_effort (and enable_thinking from it)."""
    extra: dict[str, Any] = {}
    if body.reasoning_effort is not None:
        extra = {"reasoning_effort": body.reasoning_effort,
                 "enable_thinking": body.reasoning_effort != "none"}
    return {**extra, **(body.chat_template_kwargs or {})}


def chat_prompt(state: AppState, body: ChatCompletionRequest,
                add_generation_prompt: bool) -> list[int]:
    text = render(state.tokenizer, body.messages, add_generation_prompt=add_generation_prompt,
                  continue_final_message=body.continue_final_message,
                  chat_template_kwargs=template_kwargs(body), tools=body.tools,
                  documents=body.documents)
    (ids,) = encode_texts(state, [text], "messages", True, body.add_special_tokens,
                          body.truncate_prompt_tokens)
    return ids


def _entry(name: str, logprob: float) -> ChatLogprob:
    return ChatLogprob(token=name, logprob=max(logprob, MIN_LOGPROB),
                       bytes=list(name.encode("utf-8", errors="replace")))


def logprobs_content(state: AppState, body: ChatCompletionRequest, p: PositionLogprobs,
                     named: tuple[int, ...]) -> ChatLogprobsContent:
    """The chosen token and its top_logprobs: the most likely, or the named and the chosen one."""
    name = token_namer(state.tokenizer, body.return_tokens_as_token_ids)
    if p.named is None:
        top = [_entry(name(t.id), t.logprob) for t in p.top[:body.top_logprobs or 0]]
    else:
        top = [_entry(name(t), v) for t, v in zip(named, p.named)]
        if p.token.id not in named:
            top.append(_entry(name(p.token.id), p.token.logprob))
    first = _entry(name(p.token.id), p.token.logprob)
    return ChatLogprobsContent(**first.model_dump(), top_logprobs=top)


def to_choice(state: AppState, body: ChatCompletionRequest, max_tokens: int, role: str,
              res: PromptResult, named: tuple[int, ...]) -> ChatChoice:
    gen = res.next.token.id if max_tokens == 1 else None
    out = outcome(state.tokenizer, body, gen)
    content = out.text
    last = body.messages[-1]
    if body.echo and last.role == role:  # vLLM: the reply continues the last message
        content = "\n".join(texts(last, f"messages[{len(body.messages) - 1}]")) + content
    logprobs = None
    if body.logprobs:
        logprobs = ChatLogprobs(content=[] if gen is None else [
            logprobs_content(state, body, res.next, named)])
    return ChatChoice(index=0, message=ChatResponseMessage(role=role, content=content),
                      logprobs=logprobs, finish_reason=out.finish_reason,
                      stop_reason=out.stop_reason,
                      token_ids=([] if gen is None else [gen]) if body.return_token_ids else None)


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, state: State,
                           request: Request) -> Response:
    max_tokens = check_supported(body)
    add_generation_prompt = generation_prompt(body.add_generation_prompt,
                                              body.continue_final_message)
    ids = await tokenized(state, request, body.model, chat_prompt, state, body,
                          add_generation_prompt)
    named = named_ids(state, body.logprob_token_ids)
    k = (body.top_logprobs or 0) if body.logprobs else 0
    plp = body.prompt_logprobs
    if plp is None and body.echo:
        plp = body.top_logprobs or 0  # vLLM: echo returns the prompt's logprobs too
    params = sampling_params(state, body, top_logprobs=0 if named else max(k, plp or 0),
                             prompt_logprobs=plp is not None, logprob_token_ids=named)
    (res,) = await run_prompts(state, request, [ids], params)
    # the reply's role: the assistant's, or the last message's when it is continued (vLLM)
    role = "assistant" if add_generation_prompt else body.messages[-1].role

    def answer() -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name,
            choices=[to_choice(state, body, max_tokens, role, res, named)],
            usage=CompletionUsage(
                prompt_tokens=res.prompt_tokens, completion_tokens=max_tokens,
                total_tokens=res.prompt_tokens + max_tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=res.cached_tokens)),
            prompt_logprobs=(None if plp is None
                             else prompt_logprobs_by_id(state, ids, res, plp, named)),
            prompt_token_ids=ids if body.return_token_ids else None,
            kv_transfer_params=res.kv_transfer)

    response = await json_answer(logprob_count([res], params), answer)
    state.metrics.count("ok")
    return response
