"""The attention seam: KV store + extend attention over the paged prefix, one call per layer,
between graphs (its work depends on sequence lengths); a plan binds a batch once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kernels import extend_attention as attn_kernel
from kernels import ops
from kernels.varlen import VarlenBatch
from service.model.config import ModelConfig
from service.model.meta import ForwardMeta, KVAddresses

BACKENDS = ("triton", "torch")


class AttentionBackend:
    def __init__(self, kind: str, cfg: ModelConfig):
        assert kind in BACKENDS, f"attention backend {kind!r} not in {BACKENDS}"
        self.use_triton = kind == "triton"
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.scale = cfg.softmax_scale
        # per layer: keys a query sees (None: causal over the whole prompt)
        self.windows = [cfg.window(i) or None for i in range(cfg.num_layers)]
        self.hopper = True  # False withholds the row count: never the Hopper kernel

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the fused projection: q (T, H, D), k and v (T, KVH, D)."""
        t = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d),
                qkv[:, (h + kvh) * d :].view(t, kvh, d))

    def _varlen(self, meta: ForwardMeta) -> VarlenBatch:
        return meta.varlen if self.hopper else replace(meta.varlen, num_tokens=None)

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
        ops.extend_attention(q, k, v, kv.k[layer], kv.v[layer], self._varlen(meta),
                             sm_scale=self.scale, out=out, use_triton=self.use_triton,
                             window=self.windows[layer])
        return out.view(t, h * d)

    def plan(self, qkv: torch.Tensor, meta: ForwardMeta, out: torch.Tensor) -> BreakPlan:
        """One batch's attention for every layer: qkv (T, (H+2KVH)*D), out (T, H*D), live rows."""
        t = qkv.shape[0]
        assert meta.batch_size > 0 and t == meta.num_tokens, "plan the live rows of a batch"
        q, k, v = self.split(qkv)
        out = out.view(t, self.num_heads, self.head_dim)
        slots, kv = meta.slot_mapping[:t], meta.kv
        if not self.use_triton:
            def reference(layer: int) -> None:
                kc, vc = kv.k[layer], kv.v[layer]
                ops.store_kv(k, v, kc, vc, slots, use_triton=False)
                ops.extend_attention(q, k, v, kc, vc, meta.varlen, sm_scale=self.scale, out=out,
                                     use_triton=False, window=self.windows[layer])
            return reference

        attends = self._per_layer(lambda window: attn_kernel.prepare_extend_attention(
            q, k, v, kv.k[0], kv.v[0], self._varlen(meta), self.scale, out, store_slots=slots,
            window=window)[0])
        caches = list(zip(kv.k, kv.v))

        def triton(layer: int) -> None:
            attends[layer](*caches[layer])
        return triton

    def plan_static(self, qkv: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    prefix_lens: torch.Tensor, page_table: torch.Tensor,
                    slot_mapping: torch.Tensor, addrs: KVAddresses) -> BreakPlan:
        """A full graph's attention over fixed buffers; the pool is the one `addrs` names."""
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
                batch = VarlenBatch(cu_seqlens_q, prefix_lens, page_table, live.page_size, n)
                ops.extend_attention(q, k, v, kc, vc, batch, sm_scale=self.scale, out=out,
                                     use_triton=False, window=self.windows[layer])
            return reference

        batch = VarlenBatch(cu_seqlens_q, prefix_lens, page_table, kv.page_size, n)
        attends = self._per_layer(lambda window: attn_kernel.prepare_extend_attention(
            q, k, v, kv.k[0], kv.v[0], batch, self.scale, out, store_slots=slot_mapping,
            cache_table=addrs.rows[0], window=window)[0])
        rows = addrs.rows

        def triton(layer: int) -> None:
            attends[layer](*rows[layer])
        return triton

    def _per_layer(self, prepare: Callable[[int | None], Launch]) -> list[Launch]:
        """Each layer's launch, bound once per distinct window."""
        bound = {w: prepare(w) for w in set(self.windows)}
        return [bound[w] for w in self.windows]


Launch = Callable[[torch.Tensor, torch.Tensor], None]
# A prepared break: attention (with the KV store, fused or not) of the layer it is called with
BreakPlan = Callable[[int], None]
