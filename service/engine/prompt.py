"""What the scheduler queues: a Prompt with its completion callback; the observer hooks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from service.engine.batch import SeqChunk, token_array
from service.engine.interface import PositionLogprobs, PromptResult, SamplingParams
from service.engine.pages import pages_for
from service.engine.sampling import LastRow, next_token, prompt_logprobs

# Called once with (result, None) or (None, error), from the engine thread or an abort
OnDone = Callable[[PromptResult | None, BaseException | None], None]


class Observer(Protocol):
    """The metrics hook of each forward (called from the engine thread). Per-prompt numbers
    travel in each PromptResult and are recorded where the request is answered."""

    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None: ...


class Prompt:
    """One prompt. `cancelled` is written by the submitting thread; the rest by the engine
    thread."""

    def __init__(self, token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
                 on_done: OnDone):
        assert len(token_ids), "a request needs at least one token"
        # NOTE: built here, off the engine thread; chunks and cache keys are views of it
        self.ids = token_array(token_ids)
        self.token_ids = tuple(self.ids.tolist())
        self.params = params
        self.on_done = on_done
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
