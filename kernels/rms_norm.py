"""RMSNorm and fused residual-add + RMSNorm, one program per row held in registers (N <= 65536).
Rounded as HF Llama: fp32 statistics, normalised row cast to x's dtype, then times the weight."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton


@triton.jit
def rstd(x, n_cols, eps):
    """1 / sqrt(mean(x^2) + eps) of a loaded fp32 row (zeros past n_cols)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def row_rstd(x_ptr, n_cols, eps, BLOCK_D: tl.constexpr):
    """`rstd` of the row at x_ptr (the folded-norm epilogues read it for their scale)."""
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    return rstd(x, n_cols, eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)  # the new residual, rounded like PyTorch's x + residual
        tl.store(r_ptr + row * stride_rt + cols, s, mask=mask)
        x = s.to(tl.float32)
    y = (x * rstd(x, n_cols, eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, wrap):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be (T, N) with a contiguous last dim"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {x.dtype}"
    T, N = x.shape
    assert weight.shape == (N,) and weight.is_contiguous(), f"weight shape {tuple(weight.shape)}"
    assert out.shape == (T, N) and out.stride(1) == 1 and out.dtype == x.dtype, "bad out"
    if residual is not None:
        assert residual.shape == (T, N) and residual.dtype == x.dtype and residual.stride(1) == 1
    if T == 0:
        return
    block = triton.next_power_of_2(N)
    assert block <= 65536, f"hidden size {N} too large for a one-pass row"
    kernel = wrap(_rms_norm_kernel) if wrap is not None else _rms_norm_kernel
    kernel[(T,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        N,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block,
        num_warps=min(max(block // 256, 1), 16),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, *,
    wrap=None
) -> torch.Tensor:
    """y = rms_norm(x) * weight, in x's dtype. x: (T, N), last dim contiguous."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, wrap)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual; x <- rms_norm(residual) * weight; returns both."""
    _launch(x, residual, weight, eps, x, wrap)
    return x, residual


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm, with the product cast to x's dtype."""
    y = (x.float() * row_rstd_ref(x, eps)).to(x.dtype)
    y = (weight * y).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like `fused_add_rms_norm`."""
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def row_rstd_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, 1) fp32: 1 / sqrt(mean(x^2) + eps) per row, the RMSNorm statistic."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
