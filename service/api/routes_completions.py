"""POST /v1/completions: the OpenAI legacy completions API, limited to max_tokens 0 or 1.

max_tokens=0, echo=true, logprobs=k gives prompt logprobs; temperature defaults to 0 here."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.deps import State, json_response, require_api_key
from service.api.errors import BadInput
from service.api.prompts import check_ids, encode_texts, named_ids, run_prompts, tokenized
from service.api.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    PromptTokensDetails,
)
from service.api.state import AppState
from service.engine.interface import PositionLogprobs, PromptResult, SamplingParams

router = APIRouter(prefix="/v1", tags=["completions"], dependencies=[Depends(require_api_key)])

_PREFILL_ONLY = "this is a prefill service: it computes the prompt and at most its first token"


def check_supported(body: CompletionRequest) -> int:
    """Refuse what needs decoding or cannot be honoured; return max_tokens (0 or 1)."""
    max_tokens = 1 if body.max_tokens is None else body.max_tokens
    if max_tokens > 1:
        raise BadInput(f"max_tokens={max_tokens}: {_PREFILL_ONLY} (use max_tokens 0 or 1)",
                       "max_tokens")
    if body.stream:
        raise BadInput(f"stream=true: {_PREFILL_ONLY}; use stream=false", "stream")
    if body.n != 1:
        raise BadInput(f"n={body.n}: {_PREFILL_ONLY}; only n=1 is supported", "n")
    if body.best_of not in (None, 1):
        raise BadInput(f"best_of={body.best_of}: {_PREFILL_ONLY}; only best_of=1", "best_of")
    if body.logit_bias:
        raise BadInput("logit_bias is not supported by this service", "logit_bias")
    if body.suffix:
        raise BadInput("suffix (insertion) is not supported by this service", "suffix")
    if body.logprob_token_ids and body.logprobs is None:
        raise BadInput("logprob_token_ids needs logprobs (the logprobs are returned there)",
                       "logprob_token_ids")
    return max_tokens


def prompt_inputs(state: AppState, prompt: object) -> tuple[list[list[int]], list[str | None]]:
    """Token ids per prompt, and the prompt text when it was given as text."""
    if isinstance(prompt, str):
        return encode_texts(state, [prompt], "prompt", single=True), [prompt]
    assert isinstance(prompt, list)
    if not prompt:
        raise BadInput("prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return encode_texts(state, prompt, "prompt", single=False), list(prompt)
    if isinstance(prompt[0], int):
        return check_ids(state, [prompt], "prompt", single=True), [None]
    return check_ids(state, prompt, "prompt", single=False), [None] * len(prompt)


def _top(state: AppState, p: PositionLogprobs, named: tuple[int, ...]) -> dict[str, float]:
    text = state.tokenizer.token_text
    top = ({text(t.id): t.logprob for t in p.top} if p.named is None
           else {text(t): v for t, v in zip(named, p.named)})
    top.setdefault(text(p.token.id), p.token.logprob)  # vLLM: the chosen token is always listed
    return top


def to_choice(state: AppState, i: int, body: CompletionRequest, max_tokens: int, ids: list[int],
              prompt_text: str, res: PromptResult) -> CompletionChoice:
    tok = state.tokenizer
    gen = res.next.token.id if max_tokens == 1 else None
    is_eos = gen is not None and gen == tok.eos_id
    gen_text = "" if gen is None or is_eos else tok.token_text(gen)
    finish = "stop" if is_eos else "length"
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    for s in stops:
        if s and s in gen_text:
            gen_text, finish = gen_text[:gen_text.index(s)], "stop"
    text = (prompt_text if body.echo else "") + gen_text
    logprobs = None
    if body.logprobs is not None:
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        offset = 0 if body.echo else len(prompt_text)

        def add(token_text: str, logprob: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            lp.tokens.append(token_text)
            lp.token_logprobs.append(logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(token_text)

        named = tuple(body.logprob_token_ids or ())
        if body.echo:
            add(tok.token_text(ids[0]), None, None)
            for p in res.prompt_logprobs or []:
                add(tok.token_text(p.token.id), p.token.logprob, _top(state, p, named))
        if gen is not None:
            add(tok.token_text(gen), res.next.token.logprob, _top(state, res.next, named))
        logprobs = lp
    return CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish)


@router.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, state: State,
                      request: Request) -> Response:
    max_tokens = check_supported(body)
    prompts, texts = await tokenized(state, request, body.model, prompt_inputs, state,
                                     body.prompt)
    want_lps = body.logprobs is not None
    named = named_ids(state, body.logprob_token_ids)
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            seed=body.seed, top_logprobs=0 if named else body.logprobs or 0,
                            prompt_logprobs=want_lps and body.echo,
                            logprob_token_ids=named)
    results = await run_prompts(state, request, prompts, params)
    decode = state.tokenizer.decode
    choices = [to_choice(state, i, body, max_tokens, ids,
                         text if text is not None else decode(ids), res)
               for i, (ids, text, res) in enumerate(zip(prompts, texts, results))]
    state.metrics.count("ok")
    n_prompt = sum(r.prompt_tokens for r in results)
    n_gen = max_tokens * len(results)
    return json_response(CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name,
        choices=choices,
        usage=CompletionUsage(
            prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(r.cached_tokens for r in results)))))
