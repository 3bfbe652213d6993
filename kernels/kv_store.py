"""Scatter new tokens' K and V into the paged KV pool, one program per token: cache[slot[t]] = x[t].
k, v (T, KVH, D), strided rows; padded tokens all write slot 0, a dummy nothing reads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels._triton import tl, triton
from kernels.launch import Relauncher


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < n_heads) & (offs_d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kcs + offs_h * stride_kch + offs_d, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + offs_h * stride_vch + offs_d, v, mask=mask)


def check_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Asserts k, v (T, KVH, D); caches (slots, KVH, D) in k's dtype; slot_mapping (T,) int."""
    T, KVH, D = k.shape
    assert v.shape == k.shape, f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert x.dim() == 3 and x.shape[1:] == (KVH, D), f"{name} shape {tuple(x.shape)}"
        assert x.dtype == k.dtype, f"{name} is {x.dtype}, k is {k.dtype}"
        assert x.stride(2) == 1, f"{name}: last dim must be contiguous"
    assert v.dtype == k.dtype and k.stride(2) == 1 and v.stride(2) == 1, "k, v: bad dtype/stride"
    assert slot_mapping.shape == (T,), f"slot_mapping shape {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot dtype {slot_mapping.dtype}"


def prepare_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, wrap=None
                     ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """Bind all but the caches once: `launch(k_cache, v_cache)`, or None (nothing to store)."""
    check_store(k, v, k_cache, v_cache, slot_mapping)
    T, KVH, D = k.shape
    if T == 0:
        return None
    shape = k_cache.shape
    strides = (KVH, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
               k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    meta = dict(HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(KVH),
                BLOCK_D=triton.next_power_of_2(D), num_warps=4)

    kernel = Relauncher(_store_kv_kernel, (T,), (k, v, k_cache, v_cache, slot_mapping, *strides),
                        meta, (2, 3), wrap)

    def launch(kc: torch.Tensor, vc: torch.Tensor) -> None:
        assert kc.shape == shape and vc.shape == shape, "cache differs from the prepared one"
        kernel(kc, vc)

    return launch


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, wrap=None) -> None:
    """k_cache[slot_mapping[t]] = k[t] and v_cache[slot_mapping[t]] = v[t] for every t."""
    launch = prepare_store_kv(k, v, k_cache, v_cache, slot_mapping, wrap=wrap)
    if launch is not None:
        launch(k_cache, v_cache)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kv`, with index_copy_ (duplicate dummy slots: any one wins)."""
    slots = slot_mapping.long()
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
