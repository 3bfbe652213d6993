"""First-token sampling and logprobs from fp32 logits; no HTTP, no metrics.

The reductions (log_softmax, argmax, top-k, gathers) run where the logits live, on the device in
production, and only their small results are copied to the host: copying (rows, vocab) fp32
through pageable memory and reducing it on the CPU cost more than the forward (64 rows of a
152k vocab are 39 MB). Only seeded sampling copies one row, to draw on the CPU as before.

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

from kernels import ops

MAX_TOP_LOGPROBS = 20
# Prompt-logprob rows reduced per step: the fp32 log_softmax temporary stays <= 256 x vocab
# (155 MB at a 152k vocab) however many prompt rows a forward returns.
PROMPT_ROWS_PER_STEP = 256


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


class LastRow:
    """What the first token needs from a chunk's last row: the greedy token (argmax of the raw
    logits, as `choose` picks it) and the top-min(MAX_TOP_LOGPROBS, vocab) logprobs, kept as
    `summarize`'s row until asked for: most requests want none of them, and building all of
    them cost a 128-token forward ~20 us of the H200 host's time after the GPU finished."""

    __slots__ = ("greedy", "_row", "_k")

    def __init__(self, greedy: TokenLogprob, row: list[float], k: int):
        self.greedy, self._row, self._k = greedy, row, k  # row: ids at [2, 2+k), values after

    def top_n(self, n: int) -> list[TokenLogprob]:
        """The best min(n, k) alternatives, best first."""
        n, r, k = min(n, self._k), self._row, self._k
        return _pairs(r[2:2 + n], r[2 + k:2 + k + n])

    @property
    def top(self) -> list[TokenLogprob]:
        return self.top_n(self._k)


def _pairs(ids: list[float], vals: list[float]) -> list[TokenLogprob]:
    return [TokenLogprob(int(i), v) for i, v in zip(ids, vals)]


def summary_width(vocab: int) -> int:
    """Columns of `summarize`'s output for this vocabulary."""
    return 2 + 2 * min(MAX_TOP_LOGPROBS, vocab)


def summarize(logits: torch.Tensor, out: torch.Tensor | None = None,
              logits_out: torch.Tensor | None = None) -> torch.Tensor:
    """What `LastRow` needs of each row of (B, V) logits, reduced where the logits live: a
    (B, 2 + 2k) float64 tensor (greedy id, its logprob, top-k ids, top-k logprobs; exact for ids
    and fp32 values), into `out` if given (a full CUDA graph's fixed buffer). Two launches on
    CUDA (kernels/logits_summary.py), PyTorch elsewhere; `logits_out` (B, V) fp32 also gets
    the logits, in the same pass."""
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    return ops.summarize_logits(logits, k, out, logits_out)


def unpack(packed: torch.Tensor) -> list[LastRow]:
    """`summarize`'s rows as `LastRow`s: one copy to the host."""
    k = (packed.shape[-1] - 2) // 2
    return [LastRow(TokenLogprob(int(r[0]), r[1]), r, k) for r in packed.tolist()]


def last_rows(logits: torch.Tensor) -> list[LastRow]:
    """One `LastRow` per row of (B, V) logits, reduced in one batch where the logits live and
    copied to the host as one (B, 2 + 2k) float64 tensor."""
    return unpack(summarize(logits))


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick the next token from (V,) logits: argmax, or a draw after temperature/top-k/top-p.

    Computed in float64 with the maximum subtracted before dividing by the temperature, so every
    temperature > 0 and top_p > 0 that float64 can hold gives a valid distribution: a tiny
    temperature sends every logit but the largest to -inf (greedy in the limit), and the most
    likely token always survives top-p.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.double()
    x = (x - x.max()) / params.temperature  # <= 0, the maximum at 0: no overflow
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen or make_generator(params.seed)))


def next_token(row: torch.Tensor, last: LastRow, params: SamplingParams) -> PositionLogprobs:
    """The first generated token from the last position's (V,) logits `row` and its `last_rows`
    summary. Greedy reads only the summary; sampling copies this one row to the host and draws
    with the seeded CPU generator, so a seed picks the same token wherever the row lives."""
    top = last.top_n(params.top_logprobs)
    if params.greedy:
        return PositionLogprobs(last.greedy, top)
    x = row.cpu()
    tok = choose(x, params, make_generator(params.seed))
    return PositionLogprobs(TokenLogprob(tok, float(log_softmax(x)[tok])), top)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PositionLogprobs]:
    """Logprob of `targets[i]` under row i of (N, V) logits (row i predicts the next token), and
    the top-k; reduced where the logits live, then one (N, 1 + 2k) float64 host copy."""
    assert logits.shape[0] == len(targets), f"{logits.shape[0]} rows for {len(targets)} targets"
    if not targets:
        return []
    tgt = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    parts = []
    for lo in range(0, len(targets), PROMPT_ROWS_PER_STEP):  # bounds the (rows, V) temporary
        lp = log_softmax(logits[lo:lo + PROMPT_ROWS_PER_STEP])
        vals, ids = torch.topk(lp, k, dim=-1)  # (rows, k)
        parts.append(torch.cat([lp.gather(-1, tgt[lo:lo + lp.shape[0], None]).double(),
                                ids.double(), vals.double()], dim=-1))  # (rows, 1 + 2k)
    packed = torch.cat(parts)
    return [PositionLogprobs(TokenLogprob(t, r[0]), _pairs(r[1:1 + k], r[1 + k:]))
            for t, r in zip(targets, packed.tolist())]
