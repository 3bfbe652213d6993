"""What the scheduler queues: a Prompt, prompts sharing a query's KV, the observer hook."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from service.engine.batch import SeqChunk, token_array
from service.engine.interface import PositionLogprobs, PromptResult, SamplingParams
from service.engine.pages import pages_for
from service.engine.sampling import LastRow, next_token, prompt_logprobs

log = logging.getLogger(__name__)

# Called once with (result, None) or (None, error)
OnDone = Callable[[PromptResult | None, BaseException | None], None]


class Observer(Protocol):
    """The metrics hook of each forward, on the engine thread."""

    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None: ...


class Prompt:
    """One prompt; `cancelled` is written by the submitting thread, the rest by the engine's."""

    def __init__(self, token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
                 on_done: OnDone, keys: list[bytes] | None = None):
        assert len(token_ids), "a request needs at least one token"
        self.ids = token_array(token_ids)
        self.num_tokens = len(self.ids)
        self.params = params
        self.on_done = on_done
        self.arrival = time.perf_counter()
        self.admitted_at = 0.0
        self.pages: list[int] = []
        self.done = 0  # prompt tokens in a forward already launched
        self.cached = 0
        self.keys = keys  # prefix-cache keys of the full pages (None: not computed yet)
        self.prompt_lps: list[PositionLogprobs] = []
        self.cancelled = False
        self.wants_hidden = params.pool == "last" or params.head
        self.pool_sum: torch.Tensor | None = None  # mean: the rows' sum so far; cls: row 0
        # A prompt reading a shared query's KV: the query, and the tokens it shares
        self.base: Prompt | None = None
        self.shared = 0
        self.copy_tail: tuple[int, int] | None = None  # (query page, own page) to copy first
        # A shared query: its prompts not yet over, and the pages it keeps for them meanwhile
        self.items_left = 0
        self.group_pages: list[int] = []

    def answer(self, result: PromptResult | None, exc: BaseException | None) -> None:
        try:
            self.on_done(result, exc)
        except Exception:  # noqa: BLE001 - a reply that cannot be delivered fails nothing else
            log.exception("delivering a result failed")

    def next_chunk(self, n: int, page_size: int) -> SeqChunk:
        start, end = self.done, self.done + n
        self.done = end
        named = self.params.logprob_token_ids if end == self.num_tokens else ()
        pool = self.params.pool if self.params.pool == "mean" or (
            self.params.pool == "cls" and start == 0) else ""
        return SeqChunk(self.ids[start:end], start, tuple(self.pages[:pages_for(end, page_size)]),
                        self.params.prompt_logprobs, named,
                        self.wants_hidden and end == self.num_tokens, pool,
                        self.params.head and end == self.num_tokens)

    def own_pages(self, page_size: int) -> list[int]:
        """The pages this prompt frees: not its shared query's, which the query keeps."""
        return self.pages[self.shared // page_size:] if self.base is not None else self.pages

    def item_over(self, release: Callable[[list[int]], None]) -> None:
        """On a shared query: one of its prompts is over; after the last, its pages go."""
        self.items_left -= 1
        if self.items_left == 0 and self.group_pages:
            release(self.group_pages)
            self.group_pages = []

    def absorb(self, c: SeqChunk, logits: torch.Tensor, summary: LastRow,
               hidden: torch.Tensor | None = None, pooled: torch.Tensor | None = None,
               scores: torch.Tensor | None = None) -> PromptResult | None:
        """Chunk `c`'s forward; the result once the prompt's last chunk is in."""
        end = c.prefix_len + c.num_tokens
        if pooled is not None:
            self.pool_sum = pooled if self.pool_sum is None else self.pool_sum + pooled
        last = end == self.num_tokens
        if self.params.prompt_logprobs:
            targets = self.ids[c.prefix_len + 1:min(end + 1, self.num_tokens)].tolist()
            self.prompt_lps += prompt_logprobs(logits[:len(targets)], targets,
                                               self.params.top_logprobs,
                                               self.params.logprob_token_ids)
        if not last:
            return None
        first = next_token(logits[-1], summary, self.params, self.ids)
        now = time.perf_counter()
        return PromptResult(self.num_tokens, self.cached, first,
                            self.prompt_lps if self.params.prompt_logprobs else None,
                            self.admitted_at - self.arrival, now - self.admitted_at,
                            self.embedding(hidden), None if scores is None
                            else scores.float().numpy().astype("<f4").tobytes())

    def embedding(self, hidden: torch.Tensor | None) -> bytes | None:
        """The pooled vector as float32 little-endian bytes (None: not asked)."""
        pool = self.params.pool
        if not pool:
            return None
        vec = hidden if pool == "last" else self.pool_sum
        assert vec is not None, f"pool={pool}: the forward returned no pooled rows"
        if pool == "mean":
            vec = vec / self.num_tokens
        return vec.float().numpy().astype("<f4").tobytes()


def shared_query(prompts: Sequence[np.ndarray], shared: int, params: SamplingParams,
                 on_done: Sequence[OnDone], on_query_done: OnDone,
                 query_keys: list[bytes] | None = None) -> list[Prompt]:
    """[query, *prompts]: the shared first tokens prefilled once; its failure answers for all."""
    assert len(prompts) and 0 < shared < min(map(len, prompts)), "share a proper prefix"
    query = Prompt(prompts[0][:shared], SamplingParams(), on_query_done, query_keys)
    items = [Prompt(ids, params, cb, []) for ids, cb in zip(prompts, on_done)]
    for it in items:
        it.base, it.shared = query, shared
    query.items_left = len(items)
    return [query, *items]


class NullObserver:
    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None:
        pass
