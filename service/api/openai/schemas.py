"""Bodies the OpenAI routes share: chat messages as vLLM parses them, prompt logprobs, usage."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.api.fields import ignore_unknown
from service.api.schemas import PromptTokensDetails, Text

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Part(BaseModel):
    """Unknown fields: ignored and reported (vLLM renders only the fields declared here)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _unknown(self) -> _Part:
        ignore_unknown(type(self).__name__, self.model_extra)
        return self


class ContentPart(BaseModel):
    """`{"type": "text", "text": ...}`; other types pass, for the renderer to refuse by name."""

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


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
