"""FP8 (e4m3) quantization of rows, residual-added and RMS-normed or act(gate) * up first, rounded
as the bf16 kernels round them; scales per row (amax / 448), per `group` columns or one static
scale written per row, so the GEMM reads one layout. The `_ref` functions: the same arithmetic."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from kernels.activation import ACTIVATIONS, act_and_mul_ref, activate
from kernels.rms_norm import rms_norm_ref, rstd

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # an all-zero row keeps a finite scale
ROW_MAX = 16384  # widest activation row quantized from registers in one pass


@triton.jit
def to_e4m3(y, EXACT_CAST: tl.constexpr):
    """fp32 y (|y| <= 448) to e4m3, nearest even. EXACT_CAST rounds onto e4m3's grid in fp32 first:
    Triton 3.6's interpreter drops the carry where rounding crosses a power of two (127.5 -> 64)."""
    if EXACT_CAST:
        e = tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625)))
        step = tl.exp2(e - 3.0)
        y = ((y / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: rint, ties to even
    return y.to(tl.float8e4nv)


@triton.jit
def _store_quantized(y, col0, n_cols, q_ptr, s_ptr, stride_sg, scale, GROUP: tl.constexpr,
                     STATIC: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 `y` (BLOCK columns from `col0`) into q_ptr's row, a scale per GROUP or the row's."""
    cols = col0 + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if GROUP > 0:
        g = tl.reshape(y, (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-12) / 448.0  # (BLOCK / GROUP,)
        q = tl.reshape(g / scale[:, None], (BLOCK,))
        groups = col0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + groups * stride_sg, scale, mask=groups * GROUP < n_cols)
    else:
        q = y / scale
        if STATIC:
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + cols, to_e4m3(q, EXACT_CAST), mask=mask)


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, static_ptr,
    n_cols, eps, stride_xt, stride_rt, stride_qt, stride_st, stride_sg,
    RESIDUAL: tl.constexpr, NORM: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr,
    EXACT_CAST: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    # rms_norm.py's add and norm, rounded alike: the rows the bf16 path hands its projection
    x = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)  # the new residual, rounded like PyTorch's x + residual
        tl.store(r_ptr + row * stride_rt + cols, s, mask=mask)
        x = s.to(tl.float32)
    if NORM:
        y = (x * rstd(x, n_cols, eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = (y * w).to(dtype).to(tl.float32)
    scale = 0.0
    if STATIC:
        scale = tl.load(static_ptr)
    elif GROUP == 0:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    if GROUP == 0:
        tl.store(s_ptr + row * stride_st, scale)
        _store_quantized(x, 0, n_cols, q_ptr + row * stride_qt, s_ptr, 0, scale, 0, STATIC,
                         EXACT_CAST, BLOCK_N)
    else:
        _store_quantized(x, 0, n_cols, q_ptr + row * stride_qt, s_ptr + row * stride_st,
                         stride_sg, scale, GROUP, False, EXACT_CAST, BLOCK_N)


@triton.jit
def _act_row(x_ptr, cols, n_cols, ACTIVATION: tl.constexpr):
    """act(gate) * up at `cols`, rounded to x's dtype, as fp32 (zeros past n_cols)."""
    mask = cols < n_cols
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    up = tl.load(x_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    return (activate(gate.to(tl.float32), ACTIVATION) * up).to(dtype).to(tl.float32)


@triton.jit
def _act_quantize_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, n_cols, stride_xt, stride_qt, stride_st, stride_sg,
    ACTIVATION: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr,
    EXACT_CAST: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """A block of columns a program, or a row: in registers, else two passes (amax, then values)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xt
    q_row = q_ptr + row * stride_qt
    if GROUP > 0:
        col0 = tl.program_id(1) * BLOCK_F
        y = _act_row(x_row, col0 + tl.arange(0, BLOCK_F), n_cols, ACTIVATION)
        _store_quantized(y, col0, n_cols, q_row, s_ptr + row * stride_st, stride_sg, 0.0,
                         GROUP, False, EXACT_CAST, BLOCK_F)
    elif STATIC:
        scale = tl.load(static_ptr)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + row * stride_st, scale)
        col0 = tl.program_id(1) * BLOCK_F
        y = _act_row(x_row, col0 + tl.arange(0, BLOCK_F), n_cols, ACTIVATION)
        _store_quantized(y, col0, n_cols, q_row, s_ptr, 0, scale, 0, True, EXACT_CAST, BLOCK_F)
    elif ONE_PASS:
        y = _act_row(x_row, tl.arange(0, BLOCK_F), n_cols, ACTIVATION)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
        tl.store(s_ptr + row * stride_st, scale)
        _store_quantized(y, 0, n_cols, q_row, s_ptr, 0, scale, 0, False, EXACT_CAST, BLOCK_F)
    else:
        amax = tl.zeros((BLOCK_F,), tl.float32)
        for c in range(0, n_cols, BLOCK_F):
            y = _act_row(x_row, c + tl.arange(0, BLOCK_F), n_cols, ACTIVATION)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(s_ptr + row * stride_st, scale)
        for c in range(0, n_cols, BLOCK_F):
            y = _act_row(x_row, c + tl.arange(0, BLOCK_F), n_cols, ACTIVATION)
            _store_quantized(y, c, n_cols, q_row, s_ptr, 0, scale, 0, False, EXACT_CAST,
                             BLOCK_F)


def _check_out(x_rows: int, cols: int, out: torch.Tensor, scale: torch.Tensor, group: int
               ) -> None:
    assert out.dtype == E4M3 and out.shape == (x_rows, cols) and out.stride(1) == 1, (
        f"out must be ({x_rows}, {cols}) e4m3, got {tuple(out.shape)} {out.dtype}")
    assert group == 0 or cols % group == 0, f"{cols} columns in groups of {group}"
    width = cols // group if group else 1
    assert scale.dtype == torch.float32 and scale.shape[0] == x_rows, "scale: fp32, a row each"
    assert scale.dim() == (2 if group else 1) and (not group or scale.shape[1] == width), (
        f"scale {tuple(scale.shape)} for {cols} columns in groups of {group}")


def quantize_fp8(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, *, group: int = 0,
                 static: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0, wrap=None) -> None:
    """out (T, N) e4m3 and scale of x, or of residual += x, then rms_norm(.) * `weight` if given."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be (T, N) with a contiguous last dim"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {x.dtype}"
    assert static is None or group == 0, "a static scale is one per tensor"
    T, N = x.shape
    _check_out(T, N, out, scale, group)
    if residual is not None:
        assert residual.shape == (T, N) and residual.dtype == x.dtype and residual.stride(1) == 1
    if weight is not None:
        assert weight.shape == (N,) and weight.is_contiguous(), "weight: (N,)"
    if T == 0:
        return
    block = triton.next_power_of_2(N)
    assert block <= 65536, f"{N} columns too many for a one-pass row"
    assert group == 0 or block % group == 0, f"groups of {group}"
    kernel = wrap(_quantize_kernel) if wrap is not None else _quantize_kernel
    kernel[(T,)](
        x, residual if residual is not None else x, weight if weight is not None else x,
        out, scale, static if static is not None else scale, N, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        scale.stride(0), scale.stride(1) if group else 0,
        RESIDUAL=residual is not None, NORM=weight is not None, GROUP=group,
        STATIC=static is not None, EXACT_CAST=x.device.type == "cpu", BLOCK_N=block,
        num_warps=min(max(block // 256, 1), 16),
    )


def act_and_mul_fp8(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, *,
                    activation: str = "silu", group: int = 0,
                    static: torch.Tensor | None = None, block_f: int = 1024, wrap=None) -> None:
    """act(x[:, :F]) * x[:, F:] in x's dtype into out (T, F) e4m3, scale as `quantize_fp8`'s."""
    assert activation in ACTIVATIONS, f"activation {activation!r} must be one of {ACTIVATIONS}"
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, "x must be (T, 2F)"
    assert static is None or group == 0, "a static scale is one per tensor"
    T, n = x.shape[0], x.shape[1] // 2
    _check_out(T, n, out, scale, group)
    if T == 0:
        return
    one_row = group == 0 and static is None
    # a row a program: the whole row in registers up to ROW_MAX columns (one read of gate|up)
    block = triton.next_power_of_2(n) if one_row and n <= ROW_MAX else min(
        block_f, triton.next_power_of_2(n))
    if group:
        block = max(block, group)
    kernel = wrap(_act_quantize_kernel) if wrap is not None else _act_quantize_kernel
    kernel[(T, 1 if one_row else triton.cdiv(n, block))](
        x, out, scale, static if static is not None else scale, n,
        x.stride(0), out.stride(0), scale.stride(0), scale.stride(1) if group else 0,
        ACTIVATION=activation, GROUP=group, STATIC=static is not None,
        EXACT_CAST=x.device.type == "cpu", ONE_PASS=block >= n, BLOCK_F=block,
        num_warps=min(max(block // 512, 4), 16) if block >= 512 else 1,
    )


def quantize_ref(y: torch.Tensor, group: int = 0, static: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3, fp32 scales) of y (T, N): amax / 448 a row or `group`, or `static` (saturating)."""
    yf = y.float()
    rows, cols = yf.shape
    if static is not None:
        s = static.float().reshape(())
        return (yf / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s.expand(rows).clone()
    if not group:
        scale = yf.abs().amax(-1).clamp_min(TINY) / E4M3_MAX
        return (yf / scale[:, None]).to(E4M3), scale
    assert cols % group == 0, f"{cols} columns in groups of {group}"
    g = yf.view(rows, cols // group, group)
    scale = g.abs().amax(-1).clamp_min(TINY) / E4M3_MAX
    return (g / scale[..., None]).to(E4M3).view(rows, cols), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 values * scale: a scalar, per row, per `block` columns or per block x block tile."""
    v = values.float()
    if scale.numel() == 1:
        return v * scale.float().reshape(())
    if scale.dim() == 1:
        return v * scale.float()[:, None]
    rows = 1 if scale.shape[0] == v.shape[0] else block
    full = scale.float().repeat_interleave(rows, 0).repeat_interleave(block, 1)
    return v * full[: v.shape[0], : v.shape[1]]


def quantize_fp8_ref(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, *,
                     group: int = 0, static: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> None:
    if residual is not None:
        residual.add_(x)
        x = residual
    if weight is not None:
        x = rms_norm_ref(x, weight, eps)
    values, s = quantize_ref(x, group, static)
    out.copy_(values)
    scale.copy_(s)


def act_and_mul_fp8_ref(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, *,
                        activation: str = "silu", group: int = 0,
                        static: torch.Tensor | None = None) -> None:
    values, s = quantize_ref(act_and_mul_ref(x, activation=activation), group, static)
    out.copy_(values)
    scale.copy_(s)
