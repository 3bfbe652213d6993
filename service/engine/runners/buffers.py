"""The graph runners' static buffers: one max-size set sliced per bucket; `arena`: qkv|attn|MLP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.model.config import ModelConfig
from service.model.decoder import Activations
from service.model.layers import MLP_ROW_ALIGN
from service.model.quant import Scratch

MLP_MIN_ROWS = 4096


def mlp_chunk_rows(arena_elems: int, mlp_width: int, max_tokens: int,
                   min_rows: int = MLP_ROW_ALIGN) -> int:
    """MLP scratch rows the arena holds: all `max_tokens`, else a multiple of MLP_ROW_ALIGN."""
    fit = arena_elems // mlp_width
    if fit >= max_tokens:
        return max_tokens
    floor = max(MLP_ROW_ALIGN, min_rows)
    return min(max_tokens, max(floor, fit // MLP_ROW_ALIGN * MLP_ROW_ALIGN))


@dataclass
class StaticBuffers:
    """`row_factor` > 1: MLP rows per token of a DP gather, run unchunked."""

    max_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    residual: torch.Tensor
    hidden: torch.Tensor
    arena: torch.Tensor
    qkv_width: int
    attn_width: int
    mlp_width: int  # gate|up output features
    mlp_rows: int  # MLP scratch rows per bucket token budget (max_tokens when row_factor > 1)
    row_factor: int = 1
    qin: Scratch | None = None  # the projections' inputs as their scheme stores them
    qin_mlp: Scratch | None = None
    _views: dict[int, Activations] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str, mlp_width: int, row_factor: int = 1,
                 scratch: Callable[[int, int, torch.device | str], Scratch | None] | None = None
                 ) -> StaticBuffers:
        """`scratch(rows, cols, device)`: the model's scheme's input scratch (Scheme.scratch)."""
        m, d = max_tokens, cfg.hidden_size
        qkv_w, attn_w = cfg.q_size + 2 * cfg.kv_size, cfg.q_size
        brk = m * (qkv_w + attn_w)
        mlp_rows = m if row_factor > 1 else mlp_chunk_rows(brk, mlp_width, m, MLP_MIN_ROWS)
        arena = max(brk, row_factor * mlp_rows * mlp_width)

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        qin = qin_mlp = None
        if scratch is not None:
            qin = scratch(m, max(d, attn_w), device)
            qin_mlp = scratch(row_factor * mlp_rows, mlp_width // 2, device)
        return cls(m, zeros(m, dt=torch.int64), zeros(m, dt=torch.int64), zeros(m, d),
                   zeros(m, d), zeros(arena), qkv_w, attn_w, mlp_width, mlp_rows, row_factor,
                   qin, qin_mlp)

    def views(self, n: int) -> Activations:
        if n not in self._views:
            self._views[n] = self._slice(n)
        return self._views[n]

    def _slice(self, n: int) -> Activations:
        m = self.max_tokens
        assert 0 < n <= m, f"bucket {n} outside the static buffers' {m} rows"
        a = self.arena
        qkv = a[: m * self.qkv_width].view(m, self.qkv_width)
        attn = a[m * self.qkv_width : m * (self.qkv_width + self.attn_width)].view(m, -1)
        r = self.row_factor * self.mlp_rows
        mlp = a[: r * self.mlp_width].view(r, self.mlp_width)
        return Activations(self.input_ids[:n], self.positions[:n], self.residual[:n],
                           self.hidden[:n], qkv[:n], attn[:n],
                           mlp[: self.row_factor * min(n, self.mlp_rows)], self.qin, self.qin_mlp)

    @property
    def nbytes(self) -> int:
        ts = (self.input_ids, self.positions, self.residual, self.hidden, self.arena)
        qin = sum(q.nbytes for q in (self.qin, self.qin_mlp) if q is not None)
        return sum(t.numel() * t.element_size() for t in ts) + qin
