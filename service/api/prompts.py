"""Between routes and engine: tokenize and check prompts and sampling fields, submit, await."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from starlette.requests import Request as HTTPRequest
from starlette.types import Receive

from service.api.errors import BadInput, ClientDisconnected, ModelNotFound, PromptTooLong
from service.api.schemas import Sampling
from service.api.state import AppState
from service.engine.interface import NotReady, PromptResult, SamplingParams
from service.model.text_pieces import RunTooLong
from service.text import clip

T = TypeVar("T")

# Bodies up to this size are tokenized on the event loop; larger ones in a worker thread
INLINE_BODY_BYTES = 2048
NO_HEAD = "this checkpoint has no LM head; it serves /v1/embeddings"
BIG_BODY_BYTES = 1 << 20  # larger bodies take turns (AppState.big_inputs): one's memory at once


async def off_loop(state: AppState, http: HTTPRequest, fn: Callable[..., T], *args) -> T:
    size = http.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
        return fn(*args)
    if size.isdigit() and int(size) <= BIG_BODY_BYTES:
        return await asyncio.to_thread(fn, *args)
    async with state.big_inputs:
        return await asyncio.to_thread(fn, *args)


def check_model(state: AppState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ModelNotFound(f"the model `{clip(model)}` does not exist; this server serves "
                            f"`{state.model_name}` (see /v1/models)", "model", "model_not_found")


def require_ready(state: AppState) -> None:
    if isinstance(err := state.refusal(), NotReady):
        raise err


async def tokenized(state: AppState, http: HTTPRequest, model: str | None,
                    fn: Callable[..., T], *args) -> T:
    require_ready(state)
    check_model(state, model)
    return await off_loop(state, http, fn, *args)


def too_long(name: str, count: str, state: AppState) -> PromptTooLong:
    limit, why = state.prompt_limit
    return PromptTooLong(f"{name} has {count} tokens; the limit is {limit} ({why})", name,
                         "context_length_exceeded")


def encode_texts(state: AppState, texts: Sequence[str], field: str, single: bool,
                 add_special: bool = True, truncate: int | None = None) -> list[list[int]]:
    """Token ids of each text; an over-long one is refused after about `limit` tokens of work.
    `truncate` (vLLM's truncate_prompt_tokens): the last tokens, from the tail they need."""
    out = []
    limit = state.max_prompt_tokens
    keep = None if truncate is None else min(limit if truncate == -1 else truncate, limit + 1)
    for i, text in enumerate(texts):
        name = field if single else f"{field}[{i}]"
        if not text:
            raise BadInput(f"{name} is empty", name)
        try:
            ids = (state.tokenizer.encode_within(text, limit, add_special) if keep is None
                   else state.tokenizer.encode_tail(text, keep, add_special))
        except RunTooLong as e:
            raise BadInput(f"{name}: {e}", name) from None
        if ids is None or (keep is not None and len(ids) > limit):
            raise too_long(name, f"more than {limit}", state)
        out.append(ids)
    return check_ids(state, out, field, single)


def check_ids(state: AppState, prompts: list[list[int]], field: str,
              single: bool, truncate: int | None = None) -> list[list[int]]:
    """`truncate`: vLLM's truncate_prompt_tokens, applied before the checks."""
    vocab = state.engine.info.vocab_size
    limit = state.max_prompt_tokens
    if len(prompts) > state.engine_cfg.max_queue_requests:
        raise BadInput(f"{field}: {len(prompts)} prompts in one request; at most "
                       f"{state.engine_cfg.max_queue_requests} (MAX_QUEUE_REQUESTS)", field)
    if truncate is not None:
        prompts = [truncated(list(p), truncate, limit) for p in prompts]
    for i, ids in enumerate(prompts):
        name = field if single else f"{field}[{i}]"
        if not ids:
            raise BadInput(f"{name} is empty (no tokens)", name)
        if len(ids) > limit:
            raise too_long(name, str(len(ids)), state)
        check_vocab(ids, vocab, name)
    return prompts


def check_vocab(ids: Sequence[int] | np.ndarray, vocab: int, name: str) -> None:
    """Every id of `ids` is a token of the vocabulary, else a 400 naming the first that is not."""
    if not len(ids):
        return
    if isinstance(ids, np.ndarray):
        if ids.min() >= 0 and ids.max() < vocab:
            return
        j = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
    elif min(ids) >= 0 and max(ids) < vocab:
        return
    else:
        j = next(j for j, t in enumerate(ids) if not 0 <= t < vocab)
    raise BadInput(f"{name}[{j}] = {int(ids[j])} is not a token id of this model "
                   f"(0 <= id < {vocab})", f"{name}[{j}]")


def named_ids(state: AppState, ids: list[int] | None,
              field: str = "logprob_token_ids") -> tuple[int, ...]:
    """A request's named tokens (logprob_token_ids, label_token_ids), in the vocabulary."""
    if not ids:
        return ()
    check_ids(state, [ids], field, single=True)
    return tuple(ids)


def truncated(ids: list[int], keep: int | None, limit: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: the longest prompt served)."""
    if keep is None:
        return ids
    keep = limit if keep == -1 else keep
    return ids[-keep:] if keep else []


def sampling_params(state: AppState, body: Sampling, *, top_logprobs: int = 0,
                    prompt_logprobs: bool = False,
                    logprob_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """`body`'s sampling fields with vLLM's meaning (top_k -1 off, min_tokens bans stops)."""
    vocab = state.engine.info.vocab_size
    if body.priority != 0:
        raise BadInput(f"priority={body.priority}: priority scheduling is not enabled "
                       "(the queue is first-in, first-out); send 0", "priority")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:  # vLLM's int(key): " 1 ", "+1", "1_0", "-0" and other digits ("٣", "１") are ids
            bias[int(key)] = value
        except ValueError:
            raise BadInput(f"logit_bias: the key {key[:40]!r} is not a token id",
                           "logit_bias") from None
    check_vocab(list(bias), vocab, "logit_bias")
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
        repetition_penalty=body.repetition_penalty, logit_bias=tuple(bias.items()),
        allowed_token_ids=allowed, banned_token_ids=banned,
        remote_decode=remote_decode(state, body.kv_transfer_params))


def remote_decode(state: AppState, params: dict | None) -> bool:
    """vLLM's `kv_transfer_params.do_remote_decode`; ignored without KV_TRANSFER, as by vLLM."""
    want = (params or {}).get("do_remote_decode", False)
    if not isinstance(want, bool):
        raise BadInput(f"kv_transfer_params.do_remote_decode={clip(repr(want))}: must be true or "
                       "false", "kv_transfer_params")
    return want and state.engine_cfg.kv_transfer != "none"


def one_remote_decode(params: SamplingParams, prompts: list) -> None:
    """vLLM answers one `kv_transfer_params` per response: a remote decode takes one prompt."""
    if params.remote_decode and len(prompts) != 1:
        raise BadInput(f"kv_transfer_params.do_remote_decode with {len(prompts)} prompts: send "
                       "one prompt per request", "kv_transfer_params")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_prompts(state: AppState, http: HTTPRequest, prompts: list[list[int]],
                      params: SamplingParams, shared: int = 0) -> list[PromptResult]:
    """Await all prompts as one engine request (cancelled if the client goes); `shared` > 0:
    the prompts' first `shared` tokens are the same, prefilled once."""
    require_ready(state)
    if not (params.pool or params.head) and not state.engine.info.lm_head:
        raise BadInput(NO_HEAD, "model")
    rid, results = state.engine.submit(prompts, params, shared)
    state.active_requests += 1
    watcher = asyncio.ensure_future(_wait_disconnect(http.receive))
    try:
        await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            raise ClientDisconnected()
        out = results.result()
        state.metrics.on_results(out)
        return out
    except (asyncio.CancelledError, ClientDisconnected):
        state.metrics.count("cancelled")
        raise
    finally:
        state.active_requests -= 1
        watcher.cancel()
        if not results.done():
            state.engine.cancel(rid)
            results.cancel()
