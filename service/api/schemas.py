"""Request and response bodies: the native /v1/prefill API, the OpenAI completions subset and
SGLang's /v1/score."""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
    MAX_LOGPROB_TOKEN_IDS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
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
# Every integer is bounded where it enters: token ids cross to the engine as int32. Negative
# ids within int32 pass here so that the vocabulary check can name them.
TokenId = Annotated[StrictInt, Field(ge=-MAX_INT32 - 1, le=MAX_INT32)]
TokenIds = list[TokenId]


Finite = dict(allow_inf_nan=False)


class Body(BaseModel):
    """Every request body. Unknown fields are accepted and ignored (as vLLM and SGLang do),
    new names reported at most once a minute; fields that would change the answer and are not
    served here are refused by name."""

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


class _Sampling(Body):
    """Sampling of the first token (greedy unless temperature > 0), with vLLM's fields and
    meanings."""

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
        "Accepted (llm-d, vLLM disaggregation); no KV is transferred: answered with null."))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32, description=(
        "Keep only the prompt's last k tokens; -1: the longest prompt served."))

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the longest prompt served) or keep 1 or more tokens")
        return v


class PrefillRequest(_Sampling):
    """Exactly one of `prompt` (one text), `prompts` (texts) or `input_ids` (one or many)."""

    model: Text | None = Field(None, description="Optional; must name the served model if set.")
    prompt: Text | None = None
    prompts: list[Text] | None = Field(None, min_length=1)
    input_ids: TokenIds | list[TokenIds] | None = Field(None, min_length=1)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS,
                              description="Alternatives reported for the next token.")
    prompt_logprobs: bool = Field(False, description=(
        "Return the logprob of every prompt token given its prefix (and its top_logprobs)."))
    logprob_token_ids: TokenIds | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "Token ids whose next-token logprobs are returned (`token_logprobs`, in this order) "
            "whatever their rank, at every prompt position too with prompt_logprobs."))

    @model_validator(mode="after")
    def _one_input(self) -> PrefillRequest:
        given = [n for n in ("prompt", "prompts", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, prompts or input_ids"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


class TokenInfo(BaseModel):
    id: int
    text: str
    logprob: float | None


class PromptTokenInfo(TokenInfo):
    top_logprobs: list[TokenInfo] | None = None
    token_logprobs: list[TokenInfo] | None = None


class PrefillResult(BaseModel):
    index: int
    prompt_tokens: int
    cached_tokens: int
    next_token: TokenInfo
    top_logprobs: list[TokenInfo]
    token_logprobs: list[TokenInfo] | None = None  # of the request's logprob_token_ids
    prompt_logprobs: list[PromptTokenInfo] | None = None  # one per prompt token; first: null
    queue_ms: float
    prefill_ms: float


class PrefillUsage(BaseModel):
    prompt_tokens: int
    cached_tokens: int


class PrefillResponse(BaseModel):
    id: str
    object: Literal["prefill"] = "prefill"
    model: str
    results: list[PrefillResult]
    usage: PrefillUsage


class CompletionRequest(_Sampling):
    """The OpenAI legacy completions request, limited to what one prefill can answer."""

    model: Text | None = Field(None, description="Optional; must name the served model if set.")
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


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["length", "stop"]
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    kv_transfer_params: dict[str, Any] | None = None  # no KV transfer here (vLLM's answer)


class ScoreRequest(Body):
    """SGLang's /v1/score: each item is scored as `query + item` (`item + query` with
    item_first) by the next-token probabilities of the label tokens."""

    model: Text | None = Field(None, description="Optional; must name the served model if set.")
    query: Text | TokenIds | None = Field(None, description=(
        "Text, or token ids (then items are token ids too); empty: the items are whole prompts."))
    items: Text | list[Text] | list[TokenIds] | None = None
    label_token_ids: TokenIds | None = Field(
        None, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
            "Tokens whose next-token probabilities make each item's scores, in this order."))
    apply_softmax: bool = Field(False, description=(
        "Normalise each item's scores over the labels; else each is the token's probability "
        "under the full vocabulary."))
    item_first: bool = False


class ScoreUsage(BaseModel):
    prompt_tokens: int  # of every query + item prompt, as if each were prefilled alone
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # cached: the query's KV reused, prefix cache


class ScoreResponse(BaseModel):
    scores: list[list[float]]  # per item, per label
    model: str
    usage: ScoreUsage
    object: Literal["scoring"] = "scoring"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-prefill"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
