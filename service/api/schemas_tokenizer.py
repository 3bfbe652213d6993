"""Bodies of vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info), field for field
as vLLM's TokenizeCompletionRequest / TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
DetokenizeResponse and TokenizerInfoResponse have them."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.api.schemas import Body, Text, TokenIds
from service.api.schemas_chat import ChatMessage

# fields of the chat form only (vLLM's TokenizeChatRequest)
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
               "tools")


class TokenizeRequest(Body):
    """One of `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (TokenizeChatRequest)."""

    model: Text | None = Field(None, description="Optional; must name the served model if set.")
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
    model: Text | None = Field(None, description="Optional; must name the served model if set.")
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
