"""First-token sampling and raw-logit logprobs from fp32 logits; a seed: a CPU generator."""

from __future__ import annotations

import math
import secrets

import numpy as np
import torch

from kernels import ops
from service.engine.host_copy import to_device
from service.engine.interface import (
    MAX_TOP_LOGPROBS,
    PositionLogprobs,
    SamplingParams,
    TokenLogprob,
)

# Prompt-logprob rows reduced per step: bounds the fp32 (rows, vocab) log_softmax temporary
PROMPT_ROWS_PER_STEP = 256


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


class LastRow:
    """A chunk's last row: greedy token, top-k logprobs (built when asked), named logprobs."""

    __slots__ = ("greedy", "_row", "_k", "named")

    def __init__(self, greedy: TokenLogprob, row: list[float], k: int):
        self.greedy, self._row, self._k = greedy, row, k  # row: ids at [2, 2+k), values after
        self.named: list[float] | None = None

    def top_n(self, n: int) -> list[TokenLogprob]:
        n, r, k = min(n, self._k), self._row, self._k
        return _pairs(r[2:2 + n], r[2 + k:2 + k + n])

    @property
    def top(self) -> list[TokenLogprob]:
        return self.top_n(self._k)


def _pairs(ids: list[float], vals: list[float]) -> list[TokenLogprob]:
    return [TokenLogprob(int(i), v) for i, v in zip(ids, vals)]


def summary_width(vocab: int) -> int:
    return 2 + 2 * min(MAX_TOP_LOGPROBS, vocab)


def summarize(logits: torch.Tensor, out: torch.Tensor | None = None,
              logits_out: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> (B, 2 + 2k) float64: greedy id, its logprob, top-k ids, top-k logprobs."""
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    return ops.summarize_logits(logits, k, out, logits_out)


def unpack(packed: torch.Tensor) -> list[LastRow]:
    k = (packed.shape[-1] - 2) // 2
    return [LastRow(TokenLogprob(int(r[0]), r[1]), r, k) for r in packed.tolist()]


def last_rows(logits: torch.Tensor) -> list[LastRow]:
    return unpack(summarize(logits))


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def shape(logits: torch.Tensor, params: SamplingParams, prompt: np.ndarray) -> torch.Tensor:
    """(V,) float64 logits as vLLM's sampler shapes them before temperature."""
    x = logits.double()
    if params.repetition_penalty != 1.0:
        seen = torch.from_numpy(np.unique(prompt).astype(np.int64))
        vals = x[seen]
        p = params.repetition_penalty
        x[seen] = torch.where(vals > 0, vals / p, vals * p)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[list(ids)] += torch.tensor(bias, dtype=torch.float64)
    if params.allowed_token_ids:
        keep = torch.full_like(x, float("-inf"))
        keep[list(params.allowed_token_ids)] = 0.0
        x = x + keep
    if params.banned_token_ids:
        x[list(params.banned_token_ids)] = float("-inf")
    return x


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Argmax, or a draw after temperature, min-p, top-k and top-p (vLLM's order)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.double()
    x = (x - x.max()) / params.temperature  # <= 0, the maximum at 0: no overflow
    if params.min_p > 0.0:  # p < min_p * p_max  <=>  log p - log p_max < log min_p
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))
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


def named_rows(logits: torch.Tensor, rows: list[int], ids: list[tuple[int, ...]]
               ) -> torch.Tensor:
    """(len(rows), longest ids) fp32: logprobs of `ids[i]` under row `rows[i]`, one reduction."""
    dev = logits.device
    sel = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    same = all(t == ids[0] for t in ids)
    if same:
        idx = to_device(torch.tensor(ids[0], dtype=torch.int64), dev)
    else:
        table = np.zeros((len(ids), max(map(len, ids))), np.int64)
        for i, t in enumerate(ids):
            table[i, :len(t)] = t
        idx = to_device(torch.from_numpy(table), dev)
    out = []
    for lo in range(0, len(rows), PROMPT_ROWS_PER_STEP):
        lp = log_softmax(logits.index_select(0, sel[lo:lo + PROMPT_ROWS_PER_STEP]))
        out.append(lp.index_select(-1, idx) if same else lp.gather(-1, idx[lo:lo + len(lp)]))
    return torch.cat(out)


def next_token(row: torch.Tensor, last: LastRow, params: SamplingParams,
               prompt: np.ndarray | None = None) -> PositionLogprobs:
    """The first token from `prompt`'s last (V,) logits `row`; greedy reads only the summary."""
    top = last.top_n(params.top_logprobs)
    ids = params.logprob_token_ids
    named = None
    if ids:
        assert last.named is not None, "the forward reduces a last chunk's named tokens"
        named = last.named[:len(ids)]
    if params.greedy and not params.shaped:
        return PositionLogprobs(last.greedy, top, named)
    x = row.cpu()
    shaped = shape(x, params, prompt if prompt is not None else np.zeros(0, np.int64))
    tok = choose(shaped, params, make_generator(params.seed))
    return PositionLogprobs(TokenLogprob(tok, float(log_softmax(x)[tok])), top, named)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int,
                    named: tuple[int, ...] = ()) -> list[PositionLogprobs]:
    """Logprob of `targets[i]` under row i of (N, V) logits, the top-k and the `named` tokens'."""
    assert logits.shape[0] == len(targets), f"{logits.shape[0]} rows for {len(targets)} targets"
    if not targets:
        return []
    tgt = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    parts = []
    for lo in range(0, len(targets), PROMPT_ROWS_PER_STEP):
        lp = log_softmax(logits[lo:lo + PROMPT_ROWS_PER_STEP])
        vals, ids = torch.topk(lp, k, dim=-1)  # (rows, k)
        own = lp.gather(-1, tgt[lo:lo + lp.shape[0], None])  # (rows, 1)
        rank = (lp > own).sum(-1, keepdim=True) + 1  # (rows, 1)
        parts.append(torch.cat([own.double(), rank.double(), ids.double(), vals.double()],
                               dim=-1))  # (rows, 2 + 2k)
    packed = torch.cat(parts)
    per_row = (named_rows(logits, list(range(len(targets))), [named]).tolist() if named
               else [None] * len(targets))
    return [PositionLogprobs(TokenLogprob(t, r[0]), _pairs(r[2:2 + k], r[2 + k:]), n, int(r[1]))
            for t, r, n in zip(targets, packed.tolist(), per_row)]
