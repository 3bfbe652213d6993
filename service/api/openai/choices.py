"""A completion or chat choice by vLLM's rules: the first token's text, finish_reason and
stop_reason, and the prompt logprobs keyed by token id."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from service.api.openai.schemas import PromptLogprob
from service.engine.interface import PromptResult
from service.model.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from service.api.state import AppState

PREFILL_ONLY = "this is a prefill service: it computes the prompt and at most its first token"


def token_namer(tok: TextTokenizer, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or `token_id:N` (return_tokens_as_token_ids)."""
    return (lambda t: f"token_id:{t}") if as_ids else tok.token_text


class Outcome(NamedTuple):
    text: str
    finish_reason: Literal["length", "stop"]
    stop_reason: int | str | None  # a stop token id or stop string; None for EOS or length


def outcome(tok: TextTokenizer, body: Any, gen: int | None) -> Outcome:
    """`gen`: the first token, None with max_tokens 0. `body` has vLLM's stop fields: stop,
    stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output."""
    if gen is None:
        return Outcome("", "length", None)
    if gen == tok.eos_id and not body.ignore_eos:
        return Outcome("", "stop", None)
    if gen in (body.stop_token_ids or ()):
        return Outcome("", "stop", gen)
    text = tok.decode([gen], body.skip_special_tokens)
    for s in [body.stop] if isinstance(body.stop, str) else (body.stop or []):
        if s and s in text:
            cut = text.index(s) + (len(s) if body.include_stop_str_in_output else 0)
            return Outcome(text[:cut], "stop", s)
    return Outcome(text, "length", None)


def prompt_logprobs_by_id(state: AppState, ids: list[int], res: PromptResult, k: int,
                     named: tuple[int, ...]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token but the first, its logprob, rank and top `k`."""
    text = state.tokenizer.token_text
    out: list[dict[str, PromptLogprob] | None] = [None]
    for p in res.prompt_logprobs or []:
        alts = ([(t.id, t.logprob, i + 1) for i, t in enumerate(p.top[:k])] if p.named is None
                else [(t, v, None) for t, v in zip(named, p.named)])
        entry = {str(t): PromptLogprob(logprob=v, rank=r, decoded_token=text(t))
                 for t, v, r in alts}
        entry[str(p.token.id)] = PromptLogprob(logprob=p.token.logprob, rank=p.rank,
                                               decoded_token=text(p.token.id))
        out.append(entry)
    return out[:len(ids)]
