"""First-token sampling and logprobs from fp32 logits (CPU); no HTTP, no metrics.

Reported logprobs are those of the model's own distribution (fp32 log_softmax of the raw
logits), not of the temperature/top-p/top-k-processed one, as vLLM and SGLang report by default.
Seeded sampling uses a per-request `torch.Generator`, so a seed gives the same token whatever
else shares the batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import NamedTuple

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    top_logprobs: int = 0  # alternatives reported for the next token (and prompt positions)
    prompt_logprobs: bool = False  # logprob of every prompt token given its prefix

    def __post_init__(self) -> None:
        assert self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"
        assert 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"
        assert self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"
        assert 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, (
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(NamedTuple):
    id: int
    logprob: float


class PositionLogprobs(NamedTuple):
    """One position: the chosen (or actual prompt) token and the top-k alternatives."""

    token: TokenLogprob
    top: list[TokenLogprob]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _top(logprobs: torch.Tensor, k: int) -> list[list[TokenLogprob]]:
    """Top-k of each row of (N, V) logprobs."""
    if k == 0:
        return [[] for _ in range(logprobs.shape[0])]
    vals, ids = torch.topk(logprobs, k, dim=-1)
    return [[TokenLogprob(int(i), float(v)) for i, v in zip(ri.tolist(), rv.tolist())]
            for ri, rv in zip(ids, vals)]


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick the next token from (V,) logits: argmax, or a draw after temperature/top-k/top-p."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen or make_generator(params.seed)))


def next_token(logits: torch.Tensor, params: SamplingParams) -> PositionLogprobs:
    """The first generated token from the last position's (V,) logits, with its logprobs."""
    lp = log_softmax(logits)
    tok = choose(logits, params, None if params.greedy else make_generator(params.seed))
    top = _top(lp[None], params.top_logprobs)[0]
    return PositionLogprobs(TokenLogprob(tok, float(lp[tok])), top)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PositionLogprobs]:
    """Logprob of `targets[i]` under row i of (N, V) logits (row i predicts the next token)."""
    assert logits.shape[0] == len(targets), f"{logits.shape[0]} rows for {len(targets)} targets"
    if not targets:
        return []
    lp = log_softmax(logits)  # (N, V)
    tgt = torch.tensor(targets, dtype=torch.int64)
    picked = lp.gather(-1, tgt[:, None])[:, 0].tolist()
    tops = _top(lp, k)
    return [PositionLogprobs(TokenLogprob(t, v), top) for t, v, top in zip(targets, picked, tops)]
