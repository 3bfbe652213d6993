"""Gated MLP act(gate) * up, fp32, one rounding: x (T, 2F) -> (T, F), SiLU or GeLU-tanh (Gemma);
`norm_rows`: the post-attention norm folded into gate/up (see rope.py)."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from kernels.rms_norm import row_rstd, row_rstd_ref

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def activate(gate, ACTIVATION: tl.constexpr):
    """SiLU or GeLU-tanh of an fp32 tensor."""
    if ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) = sigmoid(2z): no tanh needed, and exp's overflow gives 0 or 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi) * ...
        return gate / (1.0 + tl.exp(-2.0 * z))
    return gate / (1.0 + tl.exp(-gate))


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    norm_ptr,
    n_cols,
    stride_xt,
    stride_ot,
    stride_nt,
    norm_cols,
    eps,
    ACTIVATION: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_NORM: tl.constexpr,
    COL_ITERS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = 1.0
    if NORM:
        scale = row_rstd(norm_ptr + row * stride_nt, norm_cols, eps, BLOCK_NORM)
    for i in tl.static_range(COL_ITERS):
        cols = (tl.program_id(1) * COL_ITERS + i) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_xt + n_cols + cols, mask=mask, other=0.0)
        up = up.to(tl.float32)
        if NORM:
            gate *= scale
            up *= scale
        y = activate(gate, ACTIVATION) * up
        tl.store(out_ptr + row * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, activation: str = "silu",
    norm_rows: torch.Tensor | None = None, eps: float = 0.0, block_f: int = 1024, wrap=None
) -> torch.Tensor:
    """act(s * x[:, :F]) * s * x[:, F:], s = 1/rms(norm_rows[t]) with `norm_rows`, else 1."""
    assert activation in ACTIVATIONS, f"activation {activation!r} must be one of {ACTIVATIONS}"
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be (T, 2F), got {tuple(x.shape)}"
    assert x.stride(1) == 1, "x: last dim must be contiguous"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {x.dtype}"
    T, F2 = x.shape
    n = F2 // 2
    if out is None:
        out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    assert out.shape == (T, n) and out.dtype == x.dtype and out.stride(1) == 1, "bad out"
    norm = norm_rows is not None
    if norm:
        assert norm_rows.dim() == 2 and norm_rows.shape[0] == T and norm_rows.stride(1) == 1
        assert triton.next_power_of_2(norm_rows.shape[1]) <= 65536, "norm rows too wide"
    if T == 0 or n == 0:
        return out
    block = min(block_f, triton.next_power_of_2(n))
    # with norm_rows every program re-reads its norm row: at many rows, fewer wider programs
    iters = min(4, triton.cdiv(n, block)) if norm and T >= 1024 else 1
    kernel = wrap(_act_and_mul_kernel) if wrap is not None else _act_and_mul_kernel
    kernel[(T, triton.cdiv(n, block * iters))](
        x, out, norm_rows if norm else x, n, x.stride(0), out.stride(0),
        norm_rows.stride(0) if norm else 0, norm_rows.shape[1] if norm else 1, eps,
        ACTIVATION=activation, NORM=norm,
        BLOCK_F=block, BLOCK_NORM=triton.next_power_of_2(norm_rows.shape[1]) if norm else 1,
        COL_ITERS=iters, num_warps=4 if block >= 512 else 1,
    )
    return out


def act_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None, *,
                    activation: str = "silu", norm_rows: torch.Tensor | None = None,
                    eps: float = 0.0) -> torch.Tensor:
    """PyTorch reference, fp32 math, one rounding."""
    assert activation in ACTIVATIONS, f"activation {activation!r} must be one of {ACTIVATIONS}"
    n = x.shape[-1] // 2
    g, u = x[:, :n].float(), x[:, n:].float()
    if norm_rows is not None:
        s = row_rstd_ref(norm_rows, eps)
        g, u = g * s, u * s
    if activation == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    else:
        a = torch.nn.functional.silu(g)
    y = (a * u).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
