"""Static buffers of the graph runners: one max-size set, allocated once, sliced per bucket.

The `arena` holds qkv and attn during attention, then the MLP's gate|up in row chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service.model.config import ModelConfig
from service.model.decoder import Activations
from service.model.fp8 import Fp8Scratch
from service.model.layers import MLP_ROW_ALIGN

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
    q8: Fp8Scratch | None = None  # FP8 projections' quantized inputs (service/model/fp8.py)
    q8_mlp: Fp8Scratch | None = None
    _views: dict[int, Activations] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str, mlp_width: int, row_factor: int = 1,
                 fp8: bool = False) -> StaticBuffers:
        m, d = max_tokens, cfg.hidden_size
        qkv_w, attn_w = cfg.q_size + 2 * cfg.kv_size, cfg.q_size
        brk = m * (qkv_w + attn_w)
        mlp_rows = m if row_factor > 1 else mlp_chunk_rows(brk, mlp_width, m, MLP_MIN_ROWS)
        arena = max(brk, row_factor * mlp_rows * mlp_width)

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        q8 = q8_mlp = None
        if fp8:
            q8 = Fp8Scratch.allocate(m, max(d, attn_w), device)
            q8_mlp = Fp8Scratch.allocate(row_factor * mlp_rows, mlp_width // 2, device)
        return cls(m, zeros(m, dt=torch.int64), zeros(m, dt=torch.int64), zeros(m, d),
                   zeros(m, d), zeros(arena), qkv_w, attn_w, mlp_width, mlp_rows, row_factor,
                   q8, q8_mlp)

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
                           mlp[: self.row_factor * min(n, self.mlp_rows)], self.q8, self.q8_mlp)

    @property
    def nbytes(self) -> int:
        ts = (self.input_ids, self.positions, self.residual, self.hidden, self.arena)
        q8 = sum(q.nbytes for q in (self.q8, self.q8_mlp) if q is not None)
        return sum(t.numel() * t.element_size() for t in ts) + q8
