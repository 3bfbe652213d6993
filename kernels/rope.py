"""Rotary position embedding (neox style, rotate halves) applied in place to q and k.

Algorithm: Su et al. (2021) RoPE in the GPT-NeoX layout that Hugging Face Llama uses: with
x1 = x[..., :D/2], x2 = x[..., D/2:], out1 = x1*cos - x2*sin and out2 = x2*cos + x1*sin, where
cos/sin come from a (max_pos, D) fp32 cache (cos in [:, :D/2], sin in [:, D/2:]) built by
`rope_cos_sin_cache`, which implements Llama-3 `rope_scaling` like transformers does.

Shapes: q (T, H, D), k (T, KVH, D), possibly strided views of one fused qkv buffer (last dim
contiguous); positions (T,) int32/int64. One program per token rotates all of its q and k heads,
so cos/sin are read once per token; math in fp32, one rounding to the input dtype.
"""

from __future__ import annotations

import math

import torch

from kernels._triton import tl, triton


@triton.jit
def _rotate_heads(
    x_ptr,
    n_heads,
    stride_xh,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _apply_rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    n_q_heads,
    n_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cp,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cp + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cp + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, n_q_heads, stride_qh, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, n_k_heads, stride_kh, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, H, D) and k (T, KVH, D) in place by `positions`; returns (q, k)."""
    T, H, D = q.shape
    assert k.dim() == 3 and k.shape[0] == T and k.shape[2] == D, f"k shape {tuple(k.shape)}"
    assert D % 2 == 0, f"head_dim {D} must be even"
    assert q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q, k: last dim must be contiguous"
    assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2
    assert cos_sin_cache.shape[1] == D and cos_sin_cache.stride(1) == 1, "cache must be (P, D)"
    if T == 0:
        return q, k
    kernel = wrap(_apply_rope_kernel) if wrap is not None else _apply_rope_kernel
    kernel[(T,)](
        q,
        k,
        positions,
        cos_sin_cache,
        H,
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=D // 2,
        BLOCK_HQ=triton.next_power_of_2(H),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=4,
    )
    return q, k


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like `apply_rope`; math in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]  # (T, D)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated.to(x.dtype))
    return q, k


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: scale low frequencies, blend the middle."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin_cache(
    head_dim: int, max_pos: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """(max_pos, head_dim) fp32 cache: cos(pos * inv_freq) | sin(pos * inv_freq), on the CPU.

    `scaling` is a Hugging Face `rope_scaling` dict; None or rope_type "default" means none,
    "llama3" is supported; anything else raises rather than being silently ignored.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only 'llama3')")
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # (P, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
