"""Static buffers of the graph runner: one max-size set, allocated once, sliced per bucket.

Everything a captured segment reads or writes is a slice of these, so a segment allocates
nothing and every bucket shares the same storage (no per-bucket or per-layer activations).
Lifetimes within one layer let three roles share the `arena`:

    segment (post i-1, pre i)          break i (eager)
    attn ──o_proj──> hidden ⟳ norm     qkv ──attention──> attn
    hidden ──gate_up──> arena (2F)     (qkv and attn are disjoint parts of the arena,
    silu in place ──down──> hidden      both dead before gate_up overwrites them)
    hidden ⟳ add+norm ──qkv──> qkv

The arena is sized for the break, rows·(qkv + attn) elements, not for the MLP: 2F is 2-3x
wider than qkv + attn in every real model (SmolLM2-135M: 3072 vs 1536), so sizing for it
doubled or tripled the arena. The MLP instead runs in row chunks of at most `mlp_rows` rows:
all rows when they fit, else as many as fit rounded down to a multiple of 16, and at least
MLP_MIN_ROWS (the arena grows to that many rows of 2F when the break needs less: smaller
chunks cost the large buckets measurable GEMM efficiency). Chunk shapes are fixed per
bucket, so the loop is captured like any segment. The arena never exceeds the old
max(rows·2F, rows·(qkv + attn)).

Data parallel with world > 1 keeps the unchunked scratch, world·rows gathered rows of this
rank's 2F/world: they come from and go to a collective as one block. (DP with world 1 has no
collective and chunks like the plain path.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.model.config import ModelConfig
from service.model.llama import MLP_ROW_ALIGN

# Fewest rows an MLP chunk may have. NOTE: chunks of ~1.6-2.9k rows cost Qwen2.5-0.5B and
# Llama-3.1-8B 3-6 % of their 8,192-token forward on the H200 (smaller GEMMs, partial waves:
# bench/results/e2e-h200-2026-11-29.md), so the arena grows to hold at least this many rows.
MLP_MIN_ROWS = 4096


def mlp_chunk_rows(arena_elems: int, mlp_width: int, max_tokens: int,
                   min_rows: int = MLP_ROW_ALIGN) -> int:
    """Rows of MLP scratch (gate|up, `mlp_width` wide) the arena holds: all `max_tokens` when
    they fit, else as many as fit rounded down to MLP_ROW_ALIGN, never fewer than `min_rows`."""
    fit = arena_elems // mlp_width
    if fit >= max_tokens:
        return max_tokens
    floor = max(MLP_ROW_ALIGN, min_rows)
    return min(max_tokens, max(floor, fit // MLP_ROW_ALIGN * MLP_ROW_ALIGN))


@dataclass(frozen=True)
class BucketViews:
    """The slices one bucket's segments use (n rows; DP: world·n gathered rows)."""

    n: int
    input_ids: torch.Tensor  # (n,) int64
    positions: torch.Tensor  # (n,) int64
    residual: torch.Tensor  # (n, D)
    hidden: torch.Tensor  # (n, D): MLP output, normed input of QKV, final normed output
    qkv: torch.Tensor  # (n, q + 2kv) crosses the break into attention
    attn: torch.Tensor  # (n, q) crosses the break out of attention
    # (min(n, mlp_rows), 2F), DP world > 1: (world·n, 2F/world): gate|up, then the activation in
    # place; fewer rows than n make the MLP run in row chunks (service.model.llama.swiglu)
    mlp_scratch: torch.Tensor
    gathered: torch.Tensor | None  # (world·n, D) DP only, world > 1
    partial: torch.Tensor | None  # (world·n, D) DP only, world > 1


@dataclass
class StaticBuffers:
    max_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    residual: torch.Tensor
    hidden: torch.Tensor
    arena: torch.Tensor  # flat
    qkv_width: int
    attn_width: int
    mlp_width: int  # gate|up output features of this rank's MLP (2F / world)
    mlp_rows: int  # rows of MLP scratch per rank (max_tokens when world > 1)
    world: int
    gathered: torch.Tensor | None = None
    partial: torch.Tensor | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str, mlp_width: int, world: int = 1) -> StaticBuffers:
        m, d = max_tokens, cfg.hidden_size
        qkv_w, attn_w = cfg.q_size + 2 * cfg.kv_size, cfg.q_size
        dp = world > 1
        brk = m * (qkv_w + attn_w)
        mlp_rows = m if dp else mlp_chunk_rows(brk, mlp_width, m, MLP_MIN_ROWS)
        arena = max(brk, world * mlp_rows * mlp_width)

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            max_tokens=m, input_ids=zeros(m, dt=torch.int64), positions=zeros(m, dt=torch.int64),
            residual=zeros(m, d), hidden=zeros(m, d), arena=zeros(arena), qkv_width=qkv_w,
            attn_width=attn_w, mlp_width=mlp_width, mlp_rows=mlp_rows, world=world,
            gathered=zeros(world * m, d) if dp else None,
            partial=zeros(world * m, d) if dp else None,
        )

    def __post_init__(self) -> None:
        self._views: dict[int, BucketViews] = {}

    def views(self, n: int) -> BucketViews:
        """Bucket n's slices, built once: a graph forward asks for them every time, and building
        them is a dozen tensor slices (~30 us of host time before the first segment can run)."""
        if n not in self._views:
            self._views[n] = self._slice(n)
        return self._views[n]

    def _slice(self, n: int) -> BucketViews:
        m, w = self.max_tokens, self.world
        assert 0 < n <= m, f"bucket {n} outside the static buffers' {m} rows"
        a = self.arena
        qkv = a[: m * self.qkv_width].view(m, self.qkv_width)
        attn = a[m * self.qkv_width : m * (self.qkv_width + self.attn_width)].view(m, -1)
        r = w * self.mlp_rows
        mlp = a[: r * self.mlp_width].view(r, self.mlp_width)
        return BucketViews(
            n=n, input_ids=self.input_ids[:n], positions=self.positions[:n],
            residual=self.residual[:n], hidden=self.hidden[:n], qkv=qkv[:n], attn=attn[:n],
            mlp_scratch=mlp[: w * min(n, self.mlp_rows)],
            gathered=self.gathered[: w * n] if self.gathered is not None else None,
            partial=self.partial[: w * n] if self.partial is not None else None,
        )

    @property
    def nbytes(self) -> int:
        ts = (self.input_ids, self.positions, self.residual, self.hidden, self.arena,
              self.gathered, self.partial)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
