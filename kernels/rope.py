"""Rotary embedding (GPT-NeoX halves, as HF Llama) in place, a program per token. `norm_rows`:
rms_norm(x) @ W^T = rstd(x) * (x @ (W*g)^T), so q, k, v get rstd, then bias, here; `q_norm`/`k_norm`
(Qwen3, Gemma 3): per-head RMSNorm before the rotation, one rounding with it."""

from __future__ import annotations

import math

import torch

from kernels._triton import tl, triton
from kernels.rms_norm import row_rstd, row_rstd_ref


@triton.jit
def _rotate_heads(
    x_ptr,
    n_heads,
    stride_xh,
    cos,
    sin,
    scale,
    b_ptr,
    w_ptr,
    qk_eps,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    ROTATE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's heads in place: x <- rotate(head_norm(x * scale + bias)), each optional."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32) * scale
    x2 = x2.to(tl.float32) * scale
    if HAS_BIAS:
        b_ptrs = b_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        x1 += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(b_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # masked lanes hold 0, so the sums cover exactly the head's 2 * HALF elements
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # (BLOCK_H,)
        r = (1.0 / tl.sqrt(ss / (2 * HALF) + qk_eps))[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = x1 * r * w1
        x2 = x2 * r * w2
    if ROTATE:
        tl.store(ptrs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)
    else:
        tl.store(ptrs, x1.to(dtype), mask=mask)
        tl.store(ptrs + HALF, x2.to(dtype), mask=mask)


@triton.jit
def _apply_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    norm_ptr,
    bias_ptr,
    q_norm_ptr,
    k_norm_ptr,
    n_q_heads,
    n_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_nt,
    norm_cols,
    eps,
    qk_eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cp + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cp + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    scale = 1.0
    if NORM:
        scale = row_rstd(norm_ptr + t * stride_nt, norm_cols, eps, BLOCK_NORM)
    q_size = n_q_heads * 2 * HALF
    k_size = n_k_heads * 2 * HALF
    _rotate_heads(q_ptr + t * stride_qt, n_q_heads, stride_qh, cos, sin, scale, bias_ptr,
                  q_norm_ptr, qk_eps, HAS_BIAS, QK_NORM, True, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, n_k_heads, stride_kh, cos, sin, scale,
                  bias_ptr + q_size, k_norm_ptr, qk_eps, HAS_BIAS, QK_NORM, True, HALF, BLOCK_HK,
                  BLOCK_HALF)
    if NORM:  # v: scale and bias only, never QK-normed
        _rotate_heads(v_ptr + t * stride_vt, n_k_heads, stride_vh, cos, sin, scale,
                      bias_ptr + q_size + k_size, q_norm_ptr, qk_eps, HAS_BIAS, False, False, HALF,
                      BLOCK_HK, BLOCK_HALF)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    v: torch.Tensor | None = None,
    norm_rows: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qk_eps: float = 0.0,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place, after the optional `norm_rows` scale, `bias` and head norms."""
    T, H, D = q.shape
    assert k.dim() == 3 and k.shape[0] == T and k.shape[2] == D, f"k shape {tuple(k.shape)}"
    assert D % 2 == 0, f"head_dim {D} must be even"
    assert q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q, k: last dim must be contiguous"
    assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2
    assert cos_sin_cache.shape[1] == D and cos_sin_cache.stride(1) == 1, "cache must be (P, D)"
    kvh = k.shape[1]
    norm = norm_rows is not None
    assert norm or (v is None and bias is None), "v and bias come with norm_rows"
    if norm:
        assert v is not None and v.shape == k.shape and v.stride(2) == 1, "v must be like k"
        assert norm_rows.dim() == 2 and norm_rows.shape[0] == T and norm_rows.stride(1) == 1
        assert triton.next_power_of_2(norm_rows.shape[1]) <= 65536, "norm rows too wide"
    if bias is not None:
        width = (H + 2 * kvh) * D
        assert bias.shape == (width,) and bias.is_contiguous(), f"bias shape {tuple(bias.shape)}"
    qk_norm = q_norm is not None
    assert qk_norm == (k_norm is not None), "q_norm and k_norm come together"
    if qk_norm:
        for w in (q_norm, k_norm):
            assert w.shape == (D,) and w.is_contiguous(), f"QK-norm weight shape {tuple(w.shape)}"
    if T == 0:
        return q, k
    kernel = wrap(_apply_rope_kernel) if wrap is not None else _apply_rope_kernel
    kernel[(T,)](
        q,
        k,
        v if norm else q,
        positions,
        cos_sin_cache,
        norm_rows if norm else q,
        bias if bias is not None else q,
        q_norm if qk_norm else q,
        k_norm if qk_norm else q,
        H,
        kvh,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0) if norm else 0,
        v.stride(1) if norm else 0,
        cos_sin_cache.stride(0),
        norm_rows.stride(0) if norm else 0,
        norm_rows.shape[1] if norm else 1,
        eps,
        qk_eps,
        NORM=norm,
        HAS_BIAS=bias is not None,
        QK_NORM=qk_norm,
        HALF=D // 2,
        BLOCK_HQ=triton.next_power_of_2(H),
        BLOCK_HK=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(D // 2),
        BLOCK_NORM=triton.next_power_of_2(norm_rows.shape[1]) if norm else 1,
        num_warps=4,
    )
    return q, k


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    *, v: torch.Tensor | None = None, norm_rows: torch.Tensor | None = None, eps: float = 0.0,
    bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None, qk_eps: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like `apply_rope`; math in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    heads = [(q, q_norm, True), (k, k_norm, True)]
    if norm_rows is not None:
        heads.append((v, None, False))
    scale = 1.0 if norm_rows is None else row_rstd_ref(norm_rows, eps)[:, :, None]  # (T, 1, 1)
    at = 0
    for x, w, rotate in heads:
        y = x.float() * scale
        if bias is not None:
            n = x.shape[1] * x.shape[2]
            y = y + bias[at:at + n].float().view(1, x.shape[1], x.shape[2])
            at += n
        if w is not None:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + qk_eps) * w.float()
        if rotate:
            x1, x2 = y[..., :half], y[..., half:]
            y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(y.to(x.dtype))
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
    """(max_pos, D) fp32 cos | sin on the CPU; `scaling`: HF rope_scaling (default, llama3,
    linear), or llama.cpp's per-pair divisors ({"rope_type": "freq_factors", "factors": [...]})."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":  # positions divided by the factor
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        assert factors.shape == inv_freq.shape, f"{factors.shape[0]} RoPE factors for {head_dim}"
        inv_freq = inv_freq / factors
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
