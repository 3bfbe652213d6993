"""Request and response bodies: the native /v1/prefill API, the OpenAI completions subset and
SGLang's /v1/score."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_validator,
)

from service.engine.interface import MAX_INT32, MAX_LOGPROB_TOKEN_IDS, MAX_TOP_LOGPROBS


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


class _Sampling(BaseModel):
    """Sampling of the first token; greedy unless temperature > 0."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False,
                               description="0 = greedy (the default).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_INT32, description="0 = off.")
    seed: int | None = Field(None, ge=0, lt=1 << 63,
                             description="Same seed + same prompt = same token.")


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
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
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
    # no effect on a first token
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[Text, float] | None = None
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


class ScoreRequest(BaseModel):
    """SGLang's /v1/score: each item is scored as `query + item` (`item + query` with
    item_first) by the next-token probabilities of the label tokens."""

    model_config = ConfigDict(extra="forbid")

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
