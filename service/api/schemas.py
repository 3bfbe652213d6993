"""What every protocol's bodies share: the field types, the Body policy, vLLM's sampling fields."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.api.fields import REFUSED, ignore_unknown
from service.engine.interface import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
)


def _unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} "
                         f"at character {e.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]
# int32-bounded where it enters (ids cross as int32); negative ids pass for the vocabulary check
TokenId = Annotated[StrictInt, Field(ge=-MAX_INT32 - 1, le=MAX_INT32)]
TokenIds = list[TokenId]
ModelName = Annotated[Text | None,
                     Field(description="Optional; must name the served model if set.")]


Finite = dict(allow_inf_nan=False)


class Body(BaseModel):
    """Every request body: unknown fields ignored (as vLLM and SGLang do), REFUSED ones named."""

    model_config = ConfigDict(extra="allow")

    # declared only to be refused when set: each would change which token comes first
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    use_beam_search: Any = None
    response_format: Any = None
    chat_template: Any = None

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        if v in (None, False, "", [], {}) or (info.field_name == "response_format"
                                             and v in ({"type": "text"}, "text")):
            return v
        raise ValueError(REFUSED[info.field_name])

    @model_validator(mode="after")
    def _unknown(self) -> Body:
        ignore_unknown(type(self).__name__, self.model_extra)
        return self


class Sampling(Body):
    """Sampling of the first token (greedy unless temperature > 0), with vLLM's fields."""

    temperature: float = Field(0.0, ge=0.0, le=100.0, **Finite,
                               description="0 = greedy (the default).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, **Finite)
    top_k: int = Field(0, ge=-1, le=MAX_INT32, description="0 or -1 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, **Finite)
    seed: int | None = Field(None, ge=0, lt=1 << 63,
                             description="Same seed + same prompt = same token.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, **Finite,
                                      description="Over the prompt's tokens, as vLLM applies it.")
    logit_bias: dict[Text, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                                                  **Finite)]] | None = Field(
        None, description="Token id (as a string) -> added to its logit.")
    allowed_token_ids: TokenIds | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_INT32, description=(
        "1 or more: the first token is none of the stop tokens (EOS, stop_token_ids)."))
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    # no effect on a first token (vLLM applies them to generated tokens only)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, **Finite)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, **Finite)
    priority: int = Field(0, ge=-MAX_INT32 - 1, le=MAX_INT32,
                          description="0 only: the queue is first-in, first-out.")
    kv_transfer_params: dict[str, Any] | None = Field(None, description=(
        "vLLM's (llm-d's P/D): `do_remote_decode` leaves the KV for a vLLM decode to pull "
        "(KV_TRANSFER=nixl); ignored otherwise."))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32, description=(
        "Keep only the prompt's last k tokens; -1: the longest prompt served."))

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the longest prompt served) or keep 1 or more tokens")
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int
