"""Extend attention: new tokens attend causally to their paged cached prefix and themselves, or with
`window` W to the last W positions; q (T, H, D), k/v (T, KVH, D); rows past the batch untouched."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import extend_attention_sm90 as sm90
from kernels import kv_store
from kernels._triton import dot_flags, triton
from kernels.extend_attention_config import INTERPRETER_CONFIG, AttnConfig, packing, pick_config
from kernels.extend_attention_triton import _extend_attention_kernel
from kernels.launch import CACHE, Relauncher, call_key
from kernels.varlen import VarlenBatch

__all__ = [
    "INTERPRETER_CONFIG",
    "AttnConfig",
    "VarlenBatch",
    "extend_attention",
    "extend_attention_ref",
    "pick_config",
    "prepare_extend_attention",
]

Tensor = torch.Tensor
Launch = Callable[[Tensor, Tensor], None]
_LOG2E = 1.0 / math.log(2.0)  # exp2 softmax: log2(e) folded into the scale

SM90_MIN_TOKENS = 4096  # Hopper kernel from here: binding its TMA descriptors costs host time
SM90_MIN_TOKENS_PREPARED = 1024  # prepare_extend_attention binds once for every layer


def extend_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                     batch: VarlenBatch, sm_scale: float | None = None, out: Tensor | None = None,
                     *, config: AttnConfig | None = None, wrap: Callable | None = None,
                     window: int | None = None) -> Tensor:
    """o (T, H, D); a repeated call (kernels.launch.call_key) reuses its bound launch."""
    if out is None:
        out = q.new_empty(q.shape)
    window = _window(window, batch)
    key = None
    if wrap is None and q.is_cuda:
        key = call_key("extend_attention", (q, k, v, batch.cu_seqlens_q, batch.prefix_lens,
                                            batch.page_table), (k_cache, v_cache, out),
                       batch.page_size, batch.max_q_len, batch.max_prefix_len, batch.num_tokens,
                       sm_scale, config, window)
    launch = CACHE.get(key)
    if launch is not None:
        launch(k_cache, v_cache, out)
        return out
    if hopper := _sm90_config(q, k, v, out, batch, config, wrap, SM90_MIN_TOKENS, window):
        bound = sm90.prepare_sm90(q, k, v, batch, sm_scale, out, hopper)
        launch = None if bound is None else (lambda kc, vc, o, _b=bound: _b(o))
    else:
        bound = launch = _bind(q, k, v, k_cache, v_cache, batch, sm_scale, out, config=config,
                               wrap=wrap, store_slots=None, cache_table=None, swap=(3, 4, 5),
                               window=window)
    if launch is not None:
        launch(k_cache, v_cache, out)
        if key is not None and bound.detach():
            CACHE.put(key, launch)
    return out


def prepare_extend_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, batch: VarlenBatch,
    sm_scale: float | None = None, out: Tensor | None = None, *,
    config: AttnConfig | None = None, wrap: Callable | None = None,
    store_slots: Tensor | None = None, cache_table: tuple[Tensor, Tensor] | None = None,
    window: int | None = None,
) -> tuple[Launch | None, Tensor]:
    """(launch, o) bound once; `launch(k_cache, v_cache)` runs a layer (None: no work), also storing
    k, v at `store_slots`; `cache_table`: int64 (1,) cache addresses that launch reads instead."""
    if out is None:
        out = q.new_empty(q.shape)
    window = _window(window, batch)
    hopper = cache_table is None and _sm90_config(q, k, v, out, batch, config, wrap,
                                                  SM90_MIN_TOKENS_PREPARED, window)
    if hopper:
        fused = store_slots is not None and q.shape[2] in sm90.FUSED_STORE_HEAD_DIMS
        attend = sm90.prepare_sm90(q, k, v, batch, sm_scale, out, hopper,
                                   (k_cache, v_cache, store_slots) if fused else None)
        store = (kv_store.prepare_store_kv(k, v, k_cache, v_cache, store_slots)
                 if store_slots is not None and not fused else None)
        if attend is None:
            return None, out
        shape = k_cache.shape

        def launch_sm90(kc: Tensor, vc: Tensor) -> None:
            if fused:
                assert kc.shape == shape and vc.shape == shape, "cache differs from the prepared"
                attend(out, kc, vc)
                return
            if store is not None:
                store(kc, vc)
            attend(out)
        return launch_sm90, out
    kernel = _bind(q, k, v, k_cache, v_cache, batch, sm_scale, out, config=config, wrap=wrap,
                   store_slots=store_slots, cache_table=cache_table, swap=(3, 4),
                   window=window)
    if kernel is None:
        return None, out
    shape = k_cache.shape if cache_table is None else (1,)

    def launch(kc: Tensor, vc: Tensor) -> None:
        assert kc.shape == shape and vc.shape == shape, "cache differs from the prepared one"
        kernel(kc, vc)

    return launch, out


def _window(window: int | None, batch: VarlenBatch) -> int | None:
    """The window, or None where attention is causal: none given, or one covering every key."""
    assert window is None or window >= 0, f"window {window} must be >= 0 (0: none)"
    if not window or (batch.max_prefix_len is not None
                      and window >= batch.max_prefix_len + batch.max_q_len):
        return None
    return window


def _sm90_config(q, k, v, out, batch: VarlenBatch, config, wrap, min_tokens: int,
                 window: int | None) -> sm90.Sm90Config | None:
    """The Hopper kernel's launch shape where it is faster, else None (the Triton kernel)."""
    n = batch.num_tokens
    if batch.max_prefix_len != 0 or n is None or config is not None or wrap is not None:
        return None
    if window is not None:  # the warp-specialized kernel has no window mask
        return None
    if n < min_tokens or n > q.shape[0] or batch.max_q_len <= 0:
        return None
    return sm90.batch_config(q, batch) if sm90.supported(q, k, v, out) else None


def _bind(q, k, v, k_cache, v_cache, batch: VarlenBatch, sm_scale, out, *, config, wrap,
          store_slots, cache_table, swap, window: int | None) -> Relauncher | None:
    """The Triton kernel's checked launch (None: no work); `swap`: k_cache 3, v_cache 4, out 5."""
    T, H, D = q.shape
    KVH = k.shape[1]
    cu, prefix_lens, page_table = batch.cu_seqlens_q, batch.prefix_lens, batch.page_table
    B = prefix_lens.shape[0]
    dtype = q.dtype
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}"
    assert H % KVH == 0, f"H={H} not a multiple of KVH={KVH}"
    assert D <= 256, f"head_dim {D} > 256"
    for name, x, rows in (("q", q, T), ("k", k, T), ("v", v, T), ("k_cache", k_cache, None),
                          ("v_cache", v_cache, None), ("out", out, T)):  # fmt: skip
        assert x.dtype == dtype, f"{name} is {x.dtype}, q is {dtype}"
        assert x.dim() == 3 and x.shape[2] == D, f"{name} shape {tuple(x.shape)}"
        assert rows is None or x.shape[0] == rows, f"{name} shape {tuple(x.shape)}"
        assert x.stride(2) == 1 and x.stride(1) == D, f"{name}: heads must be packed, contiguous"
    assert out.shape[1] == H, "out must be (T, H, D)"
    assert k.shape[1] == v.shape[1] == k_cache.shape[1] == v_cache.shape[1], "KV heads differ"
    for name, x in (("cu_seqlens_q", cu), ("prefix_lens", prefix_lens),
                    ("page_table", page_table)):  # fmt: skip
        assert x.dtype == torch.int32, f"{name} must be int32, got {x.dtype}"
        assert x.device == q.device, f"{name} on {x.device}, q on {q.device}"
    assert cu.shape[0] == B + 1, "cu_seqlens_q must be (B + 1,)"
    assert page_table.dim() == 2 and page_table.shape[0] == B and page_table.stride(1) == 1
    assert k_cache.shape[0] % batch.page_size == 0, "cache slots must be whole pages"
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    assert scale > 0, "sm_scale must be positive"
    if cache_table is not None:
        for x in cache_table:
            assert x.shape == (1,) and x.dtype == torch.int64 and x.device == q.device, (
                "cache_table entries must be one-element int64 tensors of cache addresses")
    if store_slots is not None:
        assert store_slots.shape == (T,) and store_slots.dtype in (torch.int32, torch.int64), (
            f"store_slots must be ({T},) int32/int64")
    if B == 0 or batch.max_q_len <= 0 or T == 0:
        return None

    cfg = config or pick_config(D, dtype, q.device, batch.max_q_len, batch.max_prefix_len,
                                H // KVH)
    assert cfg.block_m % cfg.block_n == 0, "BLOCK_M must be a multiple of BLOCK_N"
    pack, rows = packing(cfg, H // KVH)
    block_n = min(cfg.block_n, rows)  # the diagonal loop starts at a multiple of block_n
    d_pad = max(16, triton.next_power_of_2(D))
    use_tma = cfg.use_tma and T >= cfg.tma_min_tokens and d_pad == D and dtype != torch.float32
    k_desc = v_desc = None
    if use_tma:
        k_desc, v_desc = (_tma_descriptor(x, block_n, D) for x in (k, v))
    n_m = triton.cdiv(batch.max_q_len, rows)
    heads = H if pack == 1 else KVH
    grid = (heads, n_m, B) if cfg.heads_first else (n_m, heads, B)
    args = (
        q, k, v, *(cache_table or (k_cache, v_cache)), out, k_desc, v_desc,
        cu, prefix_lens, page_table, store_slots if store_slots is not None else cu,
        scale * _LOG2E, H // KVH, window or 0,
        q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
        out.stride(0), page_table.stride(0),
    )  # fmt: skip
    meta = dict(
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, PAGE_SIZE=batch.page_size,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, USE_TMA=use_tma,
        **dot_flags(dtype, q.device.type),
        HEADS_FIRST=cfg.heads_first, PREFETCH_PAGES=cfg.prefetch_pages,
        STORE_KV=store_slots is not None,
        HAS_PREFIX=batch.max_prefix_len is None or batch.max_prefix_len > 0,
        CACHE_TABLE=cache_table is not None, PACK=pack, ROWS=rows, SLIDING=bool(window),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return Relauncher(_extend_attention_kernel, grid, args, meta, swap, wrap)


def _tma_descriptor(x: Tensor, block_n: int, head_dim: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, heads, d = x.shape  # (rows, KVH, D) with packed heads -> 2-D (rows, KVH * D)
    return TensorDescriptor(x, [rows, heads * d], [x.stride(0), 1], [block_n, head_dim])


def extend_attention_ref(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                         batch: VarlenBatch, sm_scale: float | None = None,
                         out: Tensor | None = None, *, chunk_size: int = 4096,
                         window: int | None = None) -> Tensor:
    """PyTorch reference and CPU path: per sequence, SDPA with a prefix + causal (+ window) mask."""
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = q.new_empty(q.shape)
    ps = batch.page_size
    cu = batch.cu_seqlens_q.tolist()
    for b, P in enumerate(batch.prefix_lens.tolist()):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        pos = torch.arange(P, device=q.device)
        slots = batch.page_table[b, pos // ps].long() * ps + pos % ps
        kb = torch.cat([k_cache[slots], k[s:e]]).transpose(0, 1)  # (KVH, P + L, D)
        vb = torch.cat([v_cache[slots], v[s:e]]).transpose(0, 1)
        for c0 in range(0, e - s, chunk_size):
            c1 = min(e - s, c0 + chunk_size)
            n_keys = P + c1
            qc = q[s + c0 : s + c1].transpose(0, 1)
            key_pos = torch.arange(n_keys, device=q.device)[None, :]
            query_pos = P + torch.arange(c0, c1, device=q.device)[:, None]
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
            oc = F.scaled_dot_product_attention(qc, kb[:, :n_keys], vb[:, :n_keys],
                                                attn_mask=mask, scale=scale,
                                                enable_gqa=group > 1)
            out[s + c0 : s + c1] = oc.transpose(0, 1)
    return out
