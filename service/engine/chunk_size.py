"""CPU chunk sizes: about SLICE_S of measured work each, so a cancel waits for no long prompt.

A chunk of n tokens after p costs n * (p + n + dense) query-key pairs (dense: projections, MLP)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from service.engine.batch import SeqChunk
from service.model.config import ModelConfig

SLICE_S = 1.0
MIN_TOKENS = 64  # smaller forwards cost mostly their fixed per-layer overheads


class ChunkSizer:
    def __init__(self, cfg: ModelConfig):
        h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        # projection + MLP FLOPs of a token, 2h(2q + 2kv + 3f), over a pair's QK + PV, 4q
        self.dense = h * (2 * q + 2 * kv + 3 * f) / (2 * q)
        self.rate = 0.0  # pairs per second

    def work(self, tokens: int, prefix: int) -> float:
        return tokens * (prefix + tokens + self.dense)

    def cap(self, prefix: int) -> int:
        """The most tokens after `prefix` that one slice computes (at least MIN_TOKENS)."""
        b = prefix + self.dense
        n = (math.sqrt(b * b + 4 * self.rate * SLICE_S) - b) / 2  # work(n, prefix) == budget
        return max(int(n), MIN_TOKENS)

    def measured(self, chunks: Sequence[SeqChunk], seconds: float) -> None:
        """One forward's chunks and duration; the rate follows the machine's load."""
        if seconds <= 0:
            return
        rate = sum(self.work(c.num_tokens, c.prefix_len) for c in chunks) / seconds
        self.rate = rate if not self.rate else (self.rate + rate) / 2
