"""Static buffers of the graph runner: one max-size set, allocated once, sliced per bucket.

Everything a captured segment reads or writes is a slice of these, so a segment allocates
nothing and every bucket shares the same storage (no per-bucket or per-layer activations).
Lifetimes within one layer let three roles share the `arena`:

    segment (post i-1, pre i)          break i (eager)
    attn ──o_proj──> hidden ⟳ norm     qkv ──attention──> attn
    hidden ──gate_up──> arena (2F)     (qkv and attn are disjoint parts of the arena,
    silu in place ──down──> hidden      both dead before gate_up overwrites them)
    hidden ⟳ add+norm ──qkv──> qkv

so the arena is max(rows·2F, rows·(qkv + attn)) elements, not their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.model.config import ModelConfig


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
    mlp_scratch: torch.Tensor  # (world·n, 2F/world): gate|up, then the activation in place
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
    world: int
    gathered: torch.Tensor | None = None
    partial: torch.Tensor | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str, mlp_width: int, world: int = 1) -> StaticBuffers:
        m, d = max_tokens, cfg.hidden_size
        qkv_w, attn_w = cfg.q_size + 2 * cfg.kv_size, cfg.q_size
        arena = max(m * world * mlp_width, m * (qkv_w + attn_w))

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        dp = world > 1
        return cls(
            max_tokens=m, input_ids=zeros(m, dt=torch.int64), positions=zeros(m, dt=torch.int64),
            residual=zeros(m, d), hidden=zeros(m, d), arena=zeros(arena), qkv_width=qkv_w,
            attn_width=attn_w, mlp_width=mlp_width, world=world,
            gathered=zeros(world * m, d) if dp else None,
            partial=zeros(world * m, d) if dp else None,
        )

    def views(self, n: int) -> BucketViews:
        m, w = self.max_tokens, self.world
        assert 0 < n <= m, f"bucket {n} outside the static buffers' {m} rows"
        a = self.arena
        qkv = a[: m * self.qkv_width].view(m, self.qkv_width)
        attn = a[m * self.qkv_width : m * (self.qkv_width + self.attn_width)].view(m, -1)
        mlp = a[: m * w * self.mlp_width].view(m * w, self.mlp_width)
        return BucketViews(
            n=n, input_ids=self.input_ids[:n], positions=self.positions[:n],
            residual=self.residual[:n], hidden=self.hidden[:n], qkv=qkv[:n], attn=attn[:n],
            mlp_scratch=mlp[: w * n],
            gathered=self.gathered[: w * n] if self.gathered is not None else None,
            partial=self.partial[: w * n] if self.partial is not None else None,
        )

    @property
    def nbytes(self) -> int:
        ts = (self.input_ids, self.positions, self.residual, self.hidden, self.arena,
              self.gathered, self.partial)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
