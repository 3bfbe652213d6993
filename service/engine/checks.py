"""The engine's checks of a Submit: a bad one fails that request alone, never the engine."""

from __future__ import annotations

import numpy as np

from service.engine import messages as m
from service.engine.interface import EngineInfo, InvalidRequest, SamplingParams
from service.engine.pages import KEY_BYTES, pages_for, split_keys

Keys = list[bytes] | None


def submit_prompts(msg: m.Submit, info: EngineInfo) -> tuple[list[np.ndarray], list[Keys]]:
    """The Submit's prompts as token arrays and their page keys, or InvalidRequest naming why."""
    n = len(msg.prompts)
    if n == 0:
        raise InvalidRequest("a request needs at least one prompt")
    for i, buf in enumerate(msg.prompts):
        if not buf or len(buf) % 4:
            raise InvalidRequest(f"prompt {i}: {len(buf)} bytes is not one or more int32 "
                                 "token ids")
    ids = [m.unpack_ids(p) for p in msg.prompts]
    for i, p in enumerate(ids):
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= info.vocab_size:
            raise InvalidRequest(f"prompt {i}: token id {lo if lo < 0 else hi} is outside the "
                                 f"vocabulary (0 <= id < {info.vocab_size})")
    check_params(msg.params, info.vocab_size)
    shared = msg.shared
    if shared:
        if n < 2 or not 0 < shared < len(ids[0]):
            raise InvalidRequest(f"a request sharing {shared} tokens needs 2 or more prompts, "
                                 "each with tokens of its own")
        head = ids[0][:shared]
        ids[1:] = [np.concatenate([head, tail]) for tail in ids[1:]]
    elif shared < 0:
        raise InvalidRequest(f"shared must be >= 0, got {shared}")
    for i, p in enumerate(ids):
        if len(p) > info.context_length:
            raise InvalidRequest(f"prompt {i}: {len(p)} tokens, more than the "
                                 f"{info.context_length} the engine serves")
    return ids, page_keys(msg.keys, ids, info.page_size)


def page_keys(blobs: list[bytes], ids: list[np.ndarray], page_size: int) -> list[Keys]:
    """Per prompt, its full pages' keys ([] sent: None, the engine computes them)."""
    if not blobs:
        return [None] * len(ids)
    if len(blobs) != len(ids):
        raise InvalidRequest(f"{len(blobs)} page-key lists for {len(ids)} prompts")
    for i, (blob, p) in enumerate(zip(blobs, ids)):
        if len(blob) % KEY_BYTES or len(blob) // KEY_BYTES > len(p) // page_size:
            raise InvalidRequest(f"prompt {i}: {len(blob)} bytes of page keys for "
                                 f"{pages_for(len(p), page_size)} pages")
    return [split_keys(b) for b in blobs]


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The named tokens are the model's, and some token can still come first."""
    for name, ids in (("logprob_token_ids", params.logprob_token_ids),
                      ("logit_bias", [t for t, _ in params.logit_bias]),
                      ("allowed_token_ids", params.allowed_token_ids),
                      ("banned_token_ids", params.banned_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{name}: {bad[0]} is outside the vocabulary "
                                 f"(0 <= id < {vocab_size})")
    if params.allowed_token_ids and set(params.allowed_token_ids) <= set(
            params.banned_token_ids):
        raise InvalidRequest("every allowed token is banned: no token can come first")
