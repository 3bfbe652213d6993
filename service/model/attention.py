"""The attention seam: KV store + extend attention over the paged prefix, one call per layer.

This is the model's *break*: its work depends on per-sequence lengths, so the graph runner runs
it eagerly between captured dense segments. `triton` uses the kernels (CUDA); `torch` uses the
PyTorch references (CPU, and the accuracy baseline on GPU).

`plan(qkv, meta, out)` prepares one batch's break once (views, metadata, max_q_len) for the
graph runner, whose qkv/attention buffers are the same for every layer; calling the plan with a
layer index is then exactly one launch: attention with the KV store fused in, relaunched
through the compiled kernel (kernels/launch.py; the eager break needs no torch.ops dispatch:
it is never traced).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import extend_attention as attn_kernel
from kernels import ops
from service.model.meta import ForwardMeta, KVAddresses

BACKENDS = ("triton", "torch")


class AttentionBackend:
    def __init__(self, kind: str, num_heads: int, num_kv_heads: int, head_dim: int):
        assert kind in BACKENDS, f"attention backend {kind!r} not in {BACKENDS}"
        self.use_triton = kind == "triton"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # The kernels may pick the Hopper kernel only when told the batch's live row count;
        # withholding it keeps the plain kernel (ATTENTION_HOPPER_KERNEL=false).
        self.hopper = True

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
                             sm_scale=self.scale, out=out, use_triton=self.use_triton,
                             max_prefix_len=meta.max_prefix_len,
                             num_tokens=meta.num_tokens if self.hopper else None)
        return out.view(t, h * d)

    def plan(self, qkv: torch.Tensor, meta: ForwardMeta, out: torch.Tensor) -> BreakPlan:
        """One batch's break for every layer, as `plan(layer)`: qkv (T, (H+2KVH)*D) and out
        (T, H*D) are fixed buffers; T must be the live token count (padding rows are neither
        stored nor read). On the Triton path the launch is checked and bound here, once per
        batch; a layer then only swaps in its cache pointers."""
        t = qkv.shape[0]
        assert meta.batch_size > 0 and t == meta.num_tokens, "plan the live rows of a batch"
        q, k, v = self.split(qkv)
        out = out.view(t, self.num_heads, self.head_dim)
        slots, kv = meta.slot_mapping[:t], meta.kv
        if not self.use_triton:
            def reference(layer: int) -> None:
                kc, vc = kv.k[layer], kv.v[layer]
                ops.store_kv(k, v, kc, vc, slots, use_triton=False)
                ops.extend_attention(q, k, v, kc, vc, meta.cu_seqlens_q, meta.prefix_lens,
                                     meta.page_table, kv.page_size, meta.max_q_len,
                                     sm_scale=self.scale, out=out, use_triton=False)
            return reference

        attend, _, _ = attn_kernel.prepare_extend_attention(
            q, k, v, kv.k[0], kv.v[0], meta.cu_seqlens_q, meta.prefix_lens, meta.page_table,
            kv.page_size, meta.max_q_len, self.scale, out, store_slots=slots,
            max_prefix_len=meta.max_prefix_len, num_tokens=t if self.hopper else None)
        caches = list(zip(kv.k, kv.v))

        def triton(layer: int) -> None:
            attend(*caches[layer])  # t > 0, so the launch is not None
        return triton


    def plan_static(self, qkv: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    prefix_lens: torch.Tensor, page_table: torch.Tensor,
                    slot_mapping: torch.Tensor, addrs: KVAddresses) -> BreakPlan:
        """The break of a full CUDA graph, captured with the dense layers: every argument is a
        fixed buffer the runner refills before each replay. qkv (n, (H+2KVH)*D) and out (n, H*D)
        hold all n bucket rows; cu_seqlens_q (S+1,) may end in empty sequences; page_table
        (S, W) rows may be wider than a batch needs; slot_mapping (n,) sends padding rows to
        the dummy slot. The pool is the one `addrs` names when the plan runs (bound at capture
        for shapes and strides). Rows past cu_seqlens_q[-1] are neither attended nor written."""
        n = qkv.shape[0]
        q, k, v = self.split(qkv)
        out = out.view(n, self.num_heads, self.head_dim)
        kv = addrs.kv
        assert kv is not None, "bind the KV addresses before planning"
        if not self.use_triton:
            def reference(layer: int) -> None:
                live = addrs.kv  # read at every run, as the kernel reads the table
                kc, vc = live.k[layer], live.v[layer]
                ops.store_kv(k, v, kc, vc, slot_mapping, use_triton=False)
                ops.extend_attention(q, k, v, kc, vc, cu_seqlens_q, prefix_lens, page_table,
                                     live.page_size, n, sm_scale=self.scale, out=out,
                                     use_triton=False)
            return reference

        attend, _, _ = attn_kernel.prepare_extend_attention(
            q, k, v, kv.k[0], kv.v[0], cu_seqlens_q, prefix_lens, page_table, kv.page_size, n,
            self.scale, out, store_slots=slot_mapping, cache_table=addrs.rows[0])
        rows = addrs.rows

        def triton(layer: int) -> None:
            attend(*rows[layer])
        return triton


# A prepared break: call it with a layer index (one attention launch with the KV store fused).
BreakPlan = Callable[[int], None]
