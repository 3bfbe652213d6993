"""A small-batch GEMM over the un-normalized residual with the folded RMSNorm and the next
elementwise step in its epilogue: QKV + RoPE, or gate/up + SiLU-and-mul.

Why: with the norm weights folded into the projections (service.model.llama), a layer of a
small batch is a chain of latency-bound launches (SmolLM2-135M at 128 tokens: ~4 us per GEMM,
~2 us per RoPE or SiLU kernel, bench/results/latency-breakdown-s9-*). Folding RoPE into the
QKV GEMM and SiLU-and-mul into the gate/up GEMM removes two launches per layer, and the
per-row 1/rms comes free: the K loop reads every element of each row anyway, so it also sums
their squares.

Algorithm: the Triton tutorial's tiled matmul (fp32 accumulate) with two accumulators per
program, for the two column groups the epilogue pairs:
  rope: program n owns head n (of H + 2KVH): columns [nD, nD + D/2) and [nD + D/2, (n+1)D);
        out = rotate(rstd * acc + bias) for q and k heads (neox halves, cos/sin at the row's
        position), rstd * acc + bias for v heads; out has W's N columns.
  silu: program n owns columns [nB, nB + B) of gate and the same of up (W rows F + ...);
        out (M, F) = silu(rstd * gate) * rstd * up.
rstd = 1 / sqrt(mean(x^2) + eps) of each x row; one rounding to the output dtype.

Shapes: x (M, K) with a contiguous last dim (rows may be strided); w (N, K) contiguous: the
folded weight; bias (N,) or None (rope only); positions (M,) int; cos_sin (P, D) fp32 as in
kernels/rope.py. Sized for small M (the full graphs of small buckets): every program reloads its
x rows, and tiles are at most 64 rows.
"""

from __future__ import annotations

import torch

from kernels._triton import dot, dot_flags, tl, triton
from kernels.activation import silu_and_mul_ref
from kernels.rope import apply_rope_ref


@triton.jit
def _norm_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    pos_ptr,
    cs_ptr,
    M,
    K,
    n_cols,
    rot_heads,
    stride_xm,
    stride_om,
    stride_cp,
    eps,
    ROPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SECOND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rj = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if ROPE:  # head pid_n: its two halves (SECOND = D/2 columns apart)
        cols = pid_n * 2 * SECOND + rj
        col_mask = rj < SECOND
    else:  # gate columns; up is SECOND = F columns further
        cols = pid_n * BLOCK_N + rj
        col_mask = cols < n_cols
    m_mask = rm < M
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w1_ptrs = w_ptr + cols[None, :].to(tl.int64) * K + rk[:, None]  # (BLOCK_K, BLOCK_N) = W^T
    w2_ptrs = w1_ptrs + SECOND * K
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (rk[None, :] < k_left), other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        w_mask = col_mask[None, :] & (rk[:, None] < k_left)
        w1 = tl.load(w1_ptrs, mask=w_mask, other=0.0)
        w2 = tl.load(w2_ptrs, mask=w_mask, other=0.0)
        acc1 = dot(x, w1, acc1, DOT_PRECISION, DOT_UPCAST)
        acc2 = dot(x, w2, acc2, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w2_ptrs += BLOCK_K
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    a1 = acc1 * rstd[:, None]
    a2 = acc2 * rstd[:, None]
    if HAS_BIAS:
        a1 += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        a2 += tl.load(b_ptr + SECOND + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & col_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + cols[None, :]
    if ROPE:
        if pid_n < rot_heads:  # q and k heads rotate, v heads do not
            pos = tl.load(pos_ptr + rm, mask=m_mask, other=0).to(tl.int64)
            cs = cs_ptr + pos[:, None] * stride_cp + rj[None, :]
            cos = tl.load(cs, mask=out_mask, other=0.0)
            sin = tl.load(cs + SECOND, mask=out_mask, other=0.0)
            r1 = a1 * cos - a2 * sin
            r2 = a2 * cos + a1 * sin
            a1 = r1
            a2 = r2
        tl.store(out_ptrs, a1.to(dtype), mask=out_mask)
        tl.store(out_ptrs + SECOND, a2.to(dtype), mask=out_mask)
    else:
        y = a1 / (1.0 + tl.exp(-a1)) * a2
        tl.store(out_ptrs, y.to(dtype), mask=out_mask)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n_out: int) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be (M, K) with a contiguous last dim"
    assert w.dim() == 2 and w.is_contiguous() and w.shape[1] == x.shape[1], (
        f"w must be a contiguous (N, K) matching x's K, got {tuple(w.shape)}")
    assert w.dtype == x.dtype and out.dtype == x.dtype, f"x {x.dtype}, w {w.dtype}, {out.dtype}"
    assert out.shape == (x.shape[0], n_out) and out.stride(1) == 1, "bad out"


Tiles = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)


def _tiles(M: int, x: torch.Tensor, tiles: Tiles | None, block_n: int) -> Tiles:
    """Row tiles no taller than M needs (16..64); `block_n` columns (rope: the half head)."""
    if tiles is not None:
        return tiles
    if not x.is_cuda:  # the interpreter: small tiles
        return 16, block_n if block_n <= 64 else 16, 64, 1, 1
    return min(64, max(16, triton.next_power_of_2(M))), block_n, 64, 4, 3


def norm_qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  positions: torch.Tensor, cos_sin: torch.Tensor, eps: float, num_heads: int,
                  num_kv_heads: int, out: torch.Tensor | None = None, *,
                  tiles: Tiles | None = None, wrap=None) -> torch.Tensor:
    """out (M, (H + 2KVH) D) = RoPE'd (q, k) and v of rms_norm(x) @ W^T + bias, where w is
    the QKV weight with the norm weight folded in."""
    M, K = x.shape
    N = w.shape[0]
    heads = num_heads + 2 * num_kv_heads
    assert N % heads == 0 and (N // heads) % 2 == 0, f"{N} columns for {heads} heads"
    half = N // heads // 2
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == 2 * half
    assert cos_sin.stride(1) == 1 and positions.shape == (M,)
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous()), "bias must be (N,)"
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _check(x, w, out, N)
    if M == 0:
        return out
    # the column tile is the half head (tiles[1] is ignored)
    bm, _, bk, warps, stages = _tiles(M, x, tiles, 0)
    kernel = wrap(_norm_linear_kernel) if wrap is not None else _norm_linear_kernel
    kernel[(heads, triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, out, positions, cos_sin, M, K, N,
        num_heads + num_kv_heads, x.stride(0), out.stride(0), cos_sin.stride(0), eps, ROPE=True,
        HAS_BIAS=bias is not None, SECOND=half, **dot_flags(x.dtype, x.device.type),
        BLOCK_M=bm, BLOCK_N=max(16, triton.next_power_of_2(half)), BLOCK_K=bk,
        num_warps=warps, num_stages=stages)
    return out


def norm_gate_up_silu(x: torch.Tensor, w: torch.Tensor, eps: float,
                      out: torch.Tensor | None = None, *, tiles: Tiles | None = None,
                      wrap=None) -> torch.Tensor:
    """out (M, F) = silu(gate) * up of rms_norm(x) @ W^T, w (2F, K) the gate|up weight with
    the norm weight folded in."""
    M, K = x.shape
    F = w.shape[0] // 2
    assert w.shape[0] == 2 * F, "w must be (2F, K)"
    if out is None:
        out = torch.empty((M, F), dtype=x.dtype, device=x.device)
    _check(x, w, out, F)
    if M == 0:
        return out
    bm, bn, bk, warps, stages = _tiles(M, x, tiles, 64)
    kernel = wrap(_norm_linear_kernel) if wrap is not None else _norm_linear_kernel
    kernel[(triton.cdiv(F, bn), triton.cdiv(M, bm))](
        x, w, w, out, x, w, M, K, F, 0, x.stride(0), out.stride(0), 0, eps, ROPE=False,
        HAS_BIAS=False, SECOND=F, **dot_flags(x.dtype, x.device.type), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def norm_qkv_rope_ref(x, w, bias, positions, cos_sin, eps, num_heads, num_kv_heads, out=None):
    """PyTorch reference: the unfused chain (GEMM, then kernels/rope.py's folded epilogue)."""
    M, N = x.shape[0], w.shape[0]
    d = N // (num_heads + 2 * num_kv_heads)
    y = (x.float() @ w.float().t()).to(x.dtype)
    q = y[:, :num_heads * d].view(M, num_heads, d)
    k = y[:, num_heads * d:(num_heads + num_kv_heads) * d].view(M, num_kv_heads, d)
    v = y[:, (num_heads + num_kv_heads) * d:].view(M, num_kv_heads, d)
    apply_rope_ref(q, k, positions, cos_sin, v=v, norm_rows=x, eps=eps, bias=bias)
    if out is None:
        return y
    return out.copy_(y)


def norm_gate_up_silu_ref(x, w, eps, out=None):
    """PyTorch reference: the GEMM, then kernels/activation.py's folded SiLU-and-mul."""
    gu = (x.float() @ w.float().t()).to(x.dtype)
    return silu_and_mul_ref(gu, out, norm_rows=x, eps=eps)
