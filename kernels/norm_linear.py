"""Residual add + RMSNorm + linear + (RoPE | SiLU-and-mul) in one launch, for small batches.

Why: at ~128 rows every kernel of a layer is at its launch/latency floor (H200: ~1.5-2 us for a
norm, RoPE or SiLU launch, ~4 us for a cuBLAS GEMM), so a SmolLM2-135M forward of one short
prompt is bound by its 9 kernels per layer. This folds the norm into the GEMM's prologue and
RoPE or SiLU-and-mul into its epilogue: 5 kernels per layer instead of 9.

Algorithm: the Triton tutorial's tiled matmul (fp32 accumulate) over A = x (+ residual) with
  - RMSNorm folded in: rms_norm(s) * g @ W^T = diag(1/rms(s)) · ((s * g) @ W^T), so each program
    sums s^2 over K while it streams A, and scales its rows once at the end (one pass over A);
  - RoPE (neox) as a second accumulator: rotate_half(y) = A @ (P W)^T for a fixed signed row
    permutation P, so the program also multiplies by the partner rows of W (column d pairs with
    d +- D/2 of its head) and combines y * cos + rotate_half(y) * sin;
  - SiLU-and-mul as a second accumulator over the `up` rows (n + F): silu(gate) * up.
The residual sum s is rounded to the input dtype (as PyTorch's x + residual is) and written to
`residual_out` by the programs of the first column tile; it must not alias x or residual (other
programs still read them). Rounding differs from the unfused chain: (s * g) is rounded once to
the input dtype before the dot, and the product is not rounded between the GEMM and the
epilogue (within the bf16 tolerance of the tests).

Shapes: x, residual, residual_out (M, K), rows may be strided, last dim packed; norm weight
(K,); W (N_total, K) contiguous; bias (N_total,) or None; out (M, N) with N = N_total (RoPE or
none) or N_total / 2 (SiLU); positions (M,) int, cos_sin (P, D) fp32 as kernels/rope.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import dot, dot_flags, tl, triton

EPILOGUES = ("none", "rope", "silu")


@dataclass(frozen=True)
class Tiles:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _norm_linear_kernel(
    x_ptr, r_ptr, r_out_ptr, g_ptr, w_ptr, b_ptr, out_ptr, pos_ptr, cs_ptr,
    M, N, K, eps, rope_cols,
    stride_xm, stride_rm, stride_rom, stride_om, stride_cp,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    # the second accumulator's weight rows: RoPE partners within each head, or the `up` half
    if EPILOGUE == 1:
        d = rn % HEAD_DIM
        partner = tl.where(d < HALF, rn + HALF, rn - HALF)
        second = pid_n * BLOCK_N < rope_cols  # tiles of v columns need no partner
    else:
        partner = rn + N
        second = EPILOGUE == 2
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * K
    w2_rows = w_ptr + partner.to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        a_mask = m_mask[:, None] & k_mask[None, :]
        a = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
        dtype = a.dtype
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + rm64[:, None] * stride_rm + kk[None, :], mask=a_mask, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded like x + residual
            if pid_n == 0:
                tl.store(r_out_ptr + rm64[:, None] * stride_rom + kk[None, :], a, mask=a_mask)
        af = a.to(tl.float32)
        ss += tl.sum(af * af, axis=1)
        g = tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = (af * g[None, :]).to(dtype)
        wk_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_rows + kk[:, None], mask=wk_mask, other=0.0)  # (BLOCK_K, BLOCK_N) = W^T
        acc = dot(a, w, acc, DOT_PRECISION, DOT_UPCAST)
        if second:
            w2 = tl.load(w2_rows + kk[:, None], mask=wk_mask, other=0.0)
            acc2 = dot(a, w2, acc2, DOT_PRECISION, DOT_UPCAST)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = acc * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        if second:
            acc2 = acc2 * rstd[:, None]
            if HAS_BIAS:
                acc2 += tl.load(b_ptr + partner, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            pos = tl.load(pos_ptr + rm, mask=m_mask, other=0).to(tl.int64)
            cs = cs_ptr + pos[:, None] * stride_cp + (d % HALF)[None, :]
            cs_mask = m_mask[:, None] & n_mask[None, :]
            cos = tl.load(cs, mask=cs_mask, other=1.0)
            sin = tl.load(cs + HALF, mask=cs_mask, other=0.0)
            sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
            roped = acc * cos + sign * acc2 * sin
            acc = tl.where((rn < rope_cols)[None, :], roped, acc)
    elif EPILOGUE == 2:
        up = acc2 * rstd[:, None]
        acc = acc / (1.0 + tl.exp(-acc)) * up
    tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check(x, residual, residual_out, g, w, bias, out, epilogue, positions, cos_sin, rope_cols,
           head_dim):
    assert epilogue in EPILOGUES, f"epilogue {epilogue!r} not in {EPILOGUES}"
    m, k = x.shape
    assert x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert w.dim() == 2 and w.shape[1] == k and w.is_contiguous() and w.dtype == x.dtype
    assert g.shape == (k,), f"norm weight must be ({k},)"
    n = w.shape[0] // 2 if epilogue == "silu" else w.shape[0]
    assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == x.dtype, "bad out"
    if epilogue == "silu":
        assert w.shape[0] % 2 == 0 and bias is None, "silu: W is gate|up, no bias"
    if bias is not None:
        assert bias.shape == (w.shape[0],), "bias must be (N_total,)"
    if residual is not None:
        assert residual_out is not None, "a residual needs residual_out (it must not alias)"
        for t in (residual, residual_out):
            assert t.shape == (m, k) and t.stride(1) == 1 and t.dtype == x.dtype
        assert residual_out.data_ptr() not in (x.data_ptr(), residual.data_ptr()), (
            "residual_out must not alias x or residual: other programs still read them")
    if epilogue == "rope":
        assert positions is not None and positions.shape == (m,), "rope needs positions (M,)"
        assert cos_sin is not None and cos_sin.dtype == torch.float32
        assert cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
        assert head_dim % 2 == 0 and 0 <= rope_cols <= n and rope_cols % head_dim == 0
    return m, n, k


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                residual_out: torch.Tensor | None, g: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *,
                epilogue: str = "none", positions: torch.Tensor | None = None,
                cos_sin: torch.Tensor | None = None, rope_cols: int = 0, head_dim: int = 2,
                tiles: Tiles | None = None, wrap=None) -> torch.Tensor:
    """out = epilogue(rms_norm(x + residual) * g @ w^T + bias); residual_out <- x + residual.

    Without `residual`, x itself is normed and nothing else is written. RoPE rotates the
    first `rope_cols` output columns (q and k heads of `head_dim`) by `positions`."""
    m, n, k = _check(x, residual, residual_out, g, w, bias, out, epilogue, positions, cos_sin,
                     rope_cols, head_dim)
    if m == 0 or n == 0:
        return out
    t = tiles or Tiles()
    kernel = wrap(_norm_linear_kernel) if wrap is not None else _norm_linear_kernel
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    kernel[grid](
        x, residual if residual is not None else x, residual_out if residual is not None else x,
        g, w, bias if bias is not None else w, out,
        positions if positions is not None else x, cos_sin if cos_sin is not None else x,
        m, n, k, eps, rope_cols,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual is not None else 0, out.stride(0),
        cos_sin.stride(0) if cos_sin is not None else 0,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EPILOGUE=EPILOGUES.index(epilogue), HEAD_DIM=head_dim,
        **dot_flags(x.dtype, x.device.type),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None,
                    residual_out: torch.Tensor | None, g: torch.Tensor, eps: float,
                    w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *,
                    epilogue: str = "none", positions: torch.Tensor | None = None,
                    cos_sin: torch.Tensor | None = None, rope_cols: int = 0,
                    head_dim: int = 2) -> torch.Tensor:
    """The unfused chain, as the model runs it: add + RMSNorm (kernels/rms_norm.py rounding),
    the linear (rounded to x's dtype), then RoPE or SiLU-and-mul in fp32, rounded once."""
    from kernels.activation import silu_and_mul_ref
    from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.rope import apply_rope_ref

    _check(x, residual, residual_out, g, w, bias, out, epilogue, positions, cos_sin, rope_cols,
           head_dim)
    if residual is not None:
        h, s = fused_add_rms_norm_ref(x.clone(), residual.clone(), g, eps)
        residual_out.copy_(s)
    else:
        h = rms_norm_ref(x, g, eps)
    y = torch.nn.functional.linear(h, w, bias)
    if epilogue == "rope":
        t = y.shape[0]
        q = y[:, :rope_cols].view(t, rope_cols // head_dim, head_dim)
        apply_rope_ref(q, q[:, :0], positions, cos_sin)
    elif epilogue == "silu":
        y = silu_and_mul_ref(y)
    return out.copy_(y)
