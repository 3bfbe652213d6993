"""Bodies of POST /v1/chat/completions: OpenAI's chat request and response, with vLLM's extra
fields (add_generation_prompt, continue_final_message, chat_template_kwargs, echo,
logprob_token_ids, prompt_logprobs, ...), limited to what one prefill can answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.api.fields import ignore_unknown
from service.api.schemas import (
    CompletionUsage,
    PromptLogprob,
    Text,
    TokenIds,
    _Sampling,
)
from service.engine.interface import MAX_INT32, MAX_LOGPROB_TOKEN_IDS, MAX_TOP_LOGPROBS

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Part(BaseModel):
    """Unknown fields: ignored and reported (vLLM renders only the fields declared here)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _unknown(self) -> _Part:
        ignore_unknown(type(self).__name__, self.model_extra)
        return self


class ContentPart(BaseModel):
    """A part of a message's content: `{"type": "text", "text": ...}`. Other types (image_url,
    input_audio, ...) pass validation so that the renderer can refuse them by name."""

    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None


class FunctionCall(_Part):
    name: Text
    arguments: Text | dict[str, Any] | None = Field(None, description=(
        "JSON text (OpenAI) or an object; templates see an object, as vLLM passes it."))


class ToolCall(_Part):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Assistant messages.")
    tool_call_id: Text | None = Field(None, description="Tool messages.")
    reasoning: Text | None = Field(None, description="Assistant messages (vLLM's name).")
    reasoning_content: Text | None = Field(None, description="The same, by its older name.")


class ChatCompletionRequest(_Sampling):
    """OpenAI's chat completions request with vLLM's extra fields; max_tokens 0 or 1."""

    model: Text | None = Field(None, description="Optional; must name the served model if set.")
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
    kv_transfer_params: dict[str, Any] | None = None  # no KV transfer here (vLLM's answer)
