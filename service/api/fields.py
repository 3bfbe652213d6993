"""What the clients' request fields mean here: unknown fields logged once and ignored, fields
that would change the answer refused by name, and vLLM's sampling fields turned into the one
SamplingParams the engine knows."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from service.engine.interface import SamplingParams

if TYPE_CHECKING:
    from service.api.state import AppState

log = logging.getLogger("service.api")

_NOT_HERE = "is not supported by this prefill service"
REFUSED = {  # field -> why it is refused (each constrains or changes the first token)
    "structured_outputs": f"(structured output) {_NOT_HERE}",
    "guided_json": f"(guided decoding) {_NOT_HERE}",
    "guided_regex": f"(guided decoding) {_NOT_HERE}",
    "guided_choice": f"(guided decoding) {_NOT_HERE}",
    "guided_grammar": f"(guided decoding) {_NOT_HERE}",
    "bad_words": f"{_NOT_HERE}; allowed_token_ids or logit_bias can exclude tokens",
    "logits_processors": f"(custom logits processors) {_NOT_HERE}",
    "prompt_embeds": f"{_NOT_HERE}: send text or token ids",
    "use_beam_search": f"(beam search) {_NOT_HERE}",
    "response_format": f"other than {{\"type\": \"text\"}} {_NOT_HERE}",
    "chat_template": "(a template in the request) is not accepted: the model's own chat "
                     "template renders messages",
}

_warned: set[str] = set()
_lock = threading.Lock()


def ignore_unknown(model: str, extra: dict[str, Any] | None) -> None:
    """Log each unknown field name once per process, never per request."""
    if not extra:
        return
    with _lock:
        new = [name for name in extra if name not in _warned]
        _warned.update(new)
    for name in new:
        log.warning("ignoring the unknown request field %r (first seen in a %s; each unknown "
                    "field name is logged once)", name[:100], model)


def sampling_params(state: AppState, body: Any, *, top_logprobs: int = 0,
                    prompt_logprobs: bool = False,
                    logprob_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """`body`'s sampling fields (schemas._Sampling) with vLLM's meaning: top_k -1 is off,
    min_tokens >= 1 bans the stop tokens from coming first, priority must be 0."""
    from service.api.errors import BadInput
    from service.api.prompts import check_vocab

    vocab = state.engine.info.vocab_size
    if body.priority != 0:
        raise BadInput(f"priority={body.priority}: priority scheduling is not enabled "
                       "(the queue is first-in, first-out); send 0", "priority")
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise BadInput(f"logit_bias: the key {key[:40]!r} is not a token id", "logit_bias")
        bias.append((int(key), value))
    check_vocab([t for t, _ in bias], vocab, "logit_bias")
    allowed = tuple(body.allowed_token_ids or ())
    check_vocab(allowed, vocab, "allowed_token_ids")
    stops = tuple(body.stop_token_ids or ())
    check_vocab(stops, vocab, "stop_token_ids")
    banned: tuple[int, ...] = ()
    if body.min_tokens > 0:
        eos = state.tokenizer.eos_id
        banned = tuple(dict.fromkeys(
            ([eos] if eos is not None and not body.ignore_eos else []) + list(stops)))
    if allowed and set(allowed) <= set(banned):
        raise BadInput("every allowed token is a stop token that min_tokens keeps from "
                       "coming first", "allowed_token_ids")
    return SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        seed=body.seed, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
        logprob_token_ids=logprob_token_ids, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, logit_bias=tuple(bias),
        allowed_token_ids=allowed, banned_token_ids=banned)


def truncated(ids: list[int], keep: int | None, limit: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: the longest prompt served)."""
    if keep is None:
        return ids
    keep = limit if keep == -1 else keep
    return ids[-keep:] if keep else []
