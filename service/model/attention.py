"""The attention seam: KV store + extend attention over the paged prefix, one call per layer.

This is the model's *break*: its work depends on per-sequence lengths, so the graph runner runs
it eagerly between captured dense segments. `triton` uses the kernels (CUDA); `torch` uses the
PyTorch references (CPU, and the accuracy baseline on GPU).
"""

from __future__ import annotations

import torch

from kernels import ops
from service.model.meta import ForwardMeta

BACKENDS = ("triton", "torch")


class AttentionBackend:
    def __init__(self, kind: str, num_heads: int, num_kv_heads: int, head_dim: int):
        assert kind in BACKENDS, f"attention backend {kind!r} not in {BACKENDS}"
        self.kind = kind
        self.use_triton = kind == "triton"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def __call__(self, layer: int, qkv: torch.Tensor, meta: ForwardMeta,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """qkv (T, (H+2KVH)*D), RoPE applied; returns attention output (T, H*D)."""
        t = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : h * d].view(t, h, d)  # (T, H, D)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)  # (T, KVH, D)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # (T, KVH, D)
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
