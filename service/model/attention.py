"""The attention seam: KV store + extend attention over the paged prefix, one call per layer.

This is the model's *break*: its work depends on per-sequence lengths, so the graph runner runs
it eagerly between captured dense segments. `triton` uses the kernels (CUDA); `torch` uses the
PyTorch references (CPU, and the accuracy baseline on GPU).

`plan(qkv, meta, out)` prepares one batch's break once (views, metadata, max_q_len) for the
graph runner, whose qkv/attention buffers are the same for every layer; calling the plan with a
layer index is then exactly one KV-store launch and one attention launch, made through the
kernels' launchers directly (the eager break needs no torch.ops dispatch: it is never traced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import extend_attention as attn_kernel
from kernels import kv_store, ops
from service.model.meta import ForwardMeta

BACKENDS = ("triton", "torch")


class AttentionBackend:
    def __init__(self, kind: str, num_heads: int, num_kv_heads: int, head_dim: int):
        assert kind in BACKENDS, f"attention backend {kind!r} not in {BACKENDS}"
        self.use_triton = kind == "triton"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the fused projection: q (T, H, D), k and v (T, KVH, D)."""
        t = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d),
                qkv[:, (h + kvh) * d :].view(t, kvh, d))

    def __call__(self, layer: int, qkv: torch.Tensor, meta: ForwardMeta,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """qkv (T, (H+2KVH)*D), RoPE applied; returns attention output (T, H*D)."""
        t = qkv.shape[0]
        h, d = self.num_heads, self.head_dim
        q, k, v = self.split(qkv)
        if meta.batch_size == 0:  # a data-parallel rank with no requests: only padding rows
            return (out.zero_() if out is not None else qkv.new_zeros(t, h * d)).view(t, h * d)
        kv = meta.kv
        ops.store_kv(k, v, kv.k[layer], kv.v[layer], meta.slot_mapping[:t],
                     use_triton=self.use_triton)
        if out is None:
            out = torch.empty(t, h, d, dtype=qkv.dtype, device=qkv.device)
        else:
            out = out.view(t, h, d)
        ops.extend_attention(q, k, v, kv.k[layer], kv.v[layer], meta.cu_seqlens_q,
                             meta.prefix_lens, meta.page_table, kv.page_size, meta.max_q_len,
                             sm_scale=self.scale, out=out, use_triton=self.use_triton)
        return out.view(t, h * d)

    def plan(self, qkv: torch.Tensor, meta: ForwardMeta, out: torch.Tensor) -> BreakPlan:
        """One batch's break for every layer: qkv (T, (H+2KVH)*D) and out (T, H*D) are fixed
        buffers; T must be the live token count (padding rows are neither stored nor read)."""
        t = qkv.shape[0]
        assert meta.batch_size > 0 and t == meta.num_tokens, "plan the live rows of a batch"
        q, k, v = self.split(qkv)
        return BreakPlan(q=q, k=k, v=v, out=out.view(t, self.num_heads, self.head_dim),
                         slots=meta.slot_mapping[:t], meta=meta, max_q_len=meta.max_q_len,
                         scale=self.scale, use_triton=self.use_triton)


@dataclass(frozen=True)
class BreakPlan:
    q: torch.Tensor  # (T, H, D)
    k: torch.Tensor  # (T, KVH, D)
    v: torch.Tensor  # (T, KVH, D)
    out: torch.Tensor  # (T, H, D)
    slots: torch.Tensor  # (T,)
    meta: ForwardMeta
    max_q_len: int
    scale: float
    use_triton: bool

    def __call__(self, layer: int) -> None:
        m = self.meta
        kc, vc = m.kv.k[layer], m.kv.v[layer]
        args = (self.q, self.k, self.v, kc, vc, m.cu_seqlens_q, m.prefix_lens, m.page_table,
                m.kv.page_size, self.max_q_len, self.scale)
        if self.use_triton:
            kv_store.store_kv(self.k, self.v, kc, vc, self.slots)
            attn_kernel.extend_attention(*args, out=self.out)
        else:
            ops.store_kv(self.k, self.v, kc, vc, self.slots, use_triton=False)
            ops.extend_attention(*args, out=self.out, use_triton=False)
