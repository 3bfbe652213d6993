"""Retry-After: how long the queue takes to drain at the rate prompts finished lately."""

from __future__ import annotations

import math
from collections import deque

WINDOW_S = 30.0  # prompts finished this recently set the rate


class FinishRate:
    def __init__(self) -> None:
        self._done: deque[float] = deque(maxlen=256)
        self._rate = 0.0

    def add(self, now: float, prompts: int) -> None:
        done = self._done
        done.extend([now] * prompts)
        while done and now - done[0] > WINDOW_S:
            done.popleft()
        span = done[-1] - done[0] if len(done) > 1 else 0.0
        self._rate = (len(done) - 1) / span if span > 0 else 0.0

    def retry_after_s(self, waiting: int) -> int:
        """Seconds to drain `waiting` prompts, between 1 and 60."""
        if self._rate <= 0.0:
            return 1
        return min(max(math.ceil(waiting / self._rate), 1), 60)
