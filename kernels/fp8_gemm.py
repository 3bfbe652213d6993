"""Block-scaled FP8 GEMM: out = (a * sa) @ (w * sw)^T (+ bias); e4m3 a (M, K), w (N, K), sa (M,
K/128), sw (N/128, K/128); each 128-deep partial product goes to fp32 (Hopper's MMA sums short)."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from kernels.quant_fp8 import dequantize

SCALE_BLOCK = 128


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sa_ptr, sw_ptr, bias_ptr,
    M, N, K, stride_am, stride_wn, stride_om, stride_sam, stride_sak, stride_swn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M row tiles share each weight column tile while it is in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies fp8 bit patterns, not values
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        # BLOCK_K == 128: this step is one scale group of a and one weight tile column
        sa = tl.load(sa_ptr + offs_m * stride_sam + kb * stride_sak, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + (offs_n // 128) * stride_swn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_config(m: int) -> dict:
    """Tile sizes by the number of rows: small batches take narrow row tiles (more programs)."""
    if m <= 512:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=SCALE_BLOCK, GROUP_M=8, num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=SCALE_BLOCK, GROUP_M=8, num_warps=8,
                num_stages=4)


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
             out: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
             wrap=None) -> torch.Tensor:
    """out = a @ w^T with block scales (+ bias), shapes as above (sa in any layout)."""
    M, K = a.shape
    N = w.shape[0]
    assert a.dtype == w.dtype == torch.float8_e4m3fn and w.shape[1] == K, "e4m3 a (M, K), w (N, K)"
    assert a.stride(1) == 1 and w.stride(1) == 1 and out.stride(1) == 1, "contiguous rows"
    assert out.shape == (M, N), f"out {tuple(out.shape)} for ({M}, {N})"
    groups = triton.cdiv(K, SCALE_BLOCK)
    assert sa.shape == (M, groups) and sw.shape == (triton.cdiv(N, SCALE_BLOCK), groups), (
        f"block scales {tuple(sa.shape)}, {tuple(sw.shape)} for ({M}, {N}, {K})")
    assert sw.stride(1) == 1, "contiguous weight scale groups"
    if M == 0:
        return out
    cfg = dict(config or gemm_config(M))
    assert cfg["BLOCK_K"] == SCALE_BLOCK, "a K step is one scale group"
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    kernel = wrap(_fp8_gemm_kernel) if wrap is not None else _fp8_gemm_kernel
    kernel[grid](
        a, w, out, sa, sw, bias if bias is not None else sa, M, N, K,
        a.stride(0), w.stride(0), out.stride(0), sa.stride(0), sa.stride(1), sw.stride(0),
        HAS_BIAS=bias is not None, UPCAST=a.device.type == "cpu", **cfg,
    )
    return out


def fp8_gemm_ref(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                 out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product from fp32 dequantized operands; block scales or row-wise (M,), (N,)."""
    y = dequantize(a, sa, SCALE_BLOCK) @ dequantize(w, sw, SCALE_BLOCK).t()
    if bias is not None:
        y += bias.float()
    return out.copy_(y.to(out.dtype))
