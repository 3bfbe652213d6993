"""What the scheduler queues and returns: Prompt, PromptResult, its errors and observer hooks."""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple, Protocol

import torch

from service.engine.batch import SeqChunk, token_array
from service.engine.pages import pages_for
from service.engine.sampling import (
    LastRow,
    PositionLogprobs,
    SamplingParams,
    next_token,
    prompt_logprobs,
)


class QueueFull(Exception):
    """Too many prompts are waiting; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    """The engine is loading, draining, stopped or dead."""


class ForwardFailed(Exception):
    """The forward of this request's batch raised."""


class Observer(Protocol):
    """Plain-number hooks for metrics (called from the engine thread)."""

    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None: ...
    def on_admit(self, queue_wait_s: float) -> None: ...
    def on_finish(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None: ...


class PromptResult(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    next: PositionLogprobs  # the first generated token
    prompt_logprobs: list[PositionLogprobs] | None  # positions 1..n-1 (position 0 has none)
    queue_s: float
    prefill_s: float


class Prompt:
    """One prompt. `cancelled` is written by the loop thread; the rest by the engine thread."""

    def __init__(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        assert token_ids, "a request needs at least one token"
        self.token_ids = tuple(token_ids)
        # NOTE: built here, off the engine thread; chunks and cache keys are views of it
        self.ids = token_array(self.token_ids)
        self.params = params
        self.loop = loop
        self.future: asyncio.Future[PromptResult] = loop.create_future()
        self.arrival = time.perf_counter()
        self.admitted_at = 0.0
        self.pages: list[int] = []
        self.done = 0  # prompt tokens whose KV is written
        self.cached = 0  # prompt tokens whose KV came from the prefix cache
        self.keys: list[bytes] | None = None  # prefix-cache keys of the full pages
        self.prompt_lps: list[PositionLogprobs] = []
        self.cancelled = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk(self, n: int, page_size: int) -> SeqChunk:
        end = self.done + n
        return SeqChunk(self.token_ids[self.done:end], self.done,
                        tuple(self.pages[:pages_for(end, page_size)]),
                        all_logits=self.params.prompt_logprobs, ids=self.ids[self.done:end])


    def absorb(self, c: SeqChunk, logits: torch.Tensor, summary: LastRow
               ) -> PromptResult | None:
        """Absorb chunk `c` (`done` already advanced); returns the result once the prompt is in."""
        last = self.done == self.num_tokens
        if self.params.prompt_logprobs:
            targets = list(self.token_ids[c.prefix_len + 1:self.done])
            if not last:
                targets.append(self.token_ids[self.done])
            self.prompt_lps += prompt_logprobs(logits[:len(targets)], targets,
                                               self.params.top_logprobs)
        if not last:
            return None
        first = next_token(logits[-1], summary, self.params)
        now = time.perf_counter()
        return PromptResult(self.num_tokens, self.cached, first,
                            self.prompt_lps if self.params.prompt_logprobs else None,
                            self.admitted_at - self.arrival, now - self.admitted_at)


class NullObserver:
    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None:
        pass

    def on_admit(self, queue_wait_s: float) -> None:
        pass

    def on_finish(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        pass
