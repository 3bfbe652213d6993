"""FP8 activation quantization (kernels/quant_fp8.py) against its references: bit-equal e4m3
values and scales where both round alike, and the GPU's cast against torch's."""

import pytest
import torch

from kernels.activation import act_and_mul
from kernels.quant_fp8 import (
    E4M3,
    act_and_mul_fp8,
    act_and_mul_fp8_ref,
    quantize_fp8,
    quantize_fp8_ref,
    quantize_ref,
)
from tests.kernels.conftest import INTERPRET


def _buffers(rows: int, cols: int, group: int, device: str):
    """Group scales column-major ((rows, groups) with the rows contiguous), as the service
    lays them out for cuBLASLt."""
    scale = (torch.full((cols // group, rows), float("nan"), device=device).t() if group
             else torch.full((rows,), float("nan"), device=device))
    return torch.empty(rows, cols, dtype=E4M3, device=device), scale


def _exact(dtype: torch.dtype) -> bool:
    """NOTE: Triton 3.6's interpreter rounds fp32 -> bf16 differently from torch, so a bf16
    row can differ by an ulp before it is quantized; fp32/fp16 rows, and the GPU, are exact."""
    return not (INTERPRET and dtype == torch.bfloat16)


def _same_values(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(got.float(), want.float())
    else:  # one e4m3 step at most, on a few values
        g, w = got.float(), want.float()
        assert ((g - w).abs() <= w.abs() / 8 + 2**-9).all() and (g != w).float().mean() < 0.1


@pytest.mark.parametrize("T,N,group,static,residual,norm,dtype", [
    (5, 576, 0, None, False, False, torch.float32),  # the O projection's input
    (7, 1024, 128, None, True, True, torch.float16),  # add + norm, per 128-column group
    (3, 256, 0, 0.05, False, True, torch.float32),  # static scale: saturates
    (4, 300, 0, None, True, True, torch.bfloat16),  # odd width, bf16
    (2, 4096, 0, None, True, True, torch.bfloat16),
])
def test_quantize_matches_the_reference(T, N, group, static, residual, norm, dtype, device):
    x = (3 * torch.randn(T, N)).to(dtype).to(device)
    x[0, :7] = 0  # zeros inside a row
    if T > 2:
        x[2] = 0  # an all-zero row keeps a finite scale
    r = (5 * torch.randn(T, N)).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(N)).to(dtype).to(device)
    s = None if static is None else torch.tensor(static, device=device)
    kw = dict(group=group, static=s, weight=w if norm else None, eps=1e-5)
    r1, r2 = r.clone(), r.clone()
    out, scale = _buffers(T, N, group, device)
    quantize_fp8(x, out, scale, residual=r1 if residual else None, **kw)
    want, want_scale = _buffers(T, N, group, device)
    quantize_fp8_ref(x, want, want_scale, residual=r2 if residual else None, **kw)
    if residual:
        torch.testing.assert_close(r1, r2, rtol=0 if _exact(dtype) else 8e-3, atol=0)
    torch.testing.assert_close(scale, want_scale, rtol=0 if _exact(dtype) else 1e-2, atol=0)
    _same_values(out, want, _exact(dtype))
    if static is not None:
        assert (scale == static).all()


@pytest.mark.parametrize("T,F,group,static,activation,dtype", [
    (3, 1536, 0, None, "silu", torch.bfloat16),  # the row in registers
    (2, 17000, 0, None, "silu", torch.float16),  # wider: two passes over the row
    (2, 1024, 128, None, "gelu_tanh", torch.bfloat16),
    (4, 300, 0, 0.02, "silu", torch.float16),
    (3, 3000, 0, None, "silu", torch.float32),
])
def test_act_and_mul_quantize(T, F, group, static, activation, dtype, device):
    """The activation is the act_and_mul kernel's (bit-equal to its bf16 rows quantized);
    against the PyTorch reference, within the activation's own rounding."""
    x = (2 * torch.randn(T, 2 * F)).to(dtype).to(device)
    s = None if static is None else torch.tensor(static, device=device)
    out, scale = _buffers(T, F, group, device)
    act_and_mul_fp8(x, out, scale, activation=activation, group=group, static=s, block_f=512)
    values, scales = quantize_ref(act_and_mul(x, activation=activation), group, s)
    assert torch.equal(out.float(), values.float()) and torch.equal(scale, scales)
    want, want_scale = _buffers(T, F, group, device)
    act_and_mul_fp8_ref(x, want, want_scale, activation=activation, group=group, static=s)
    torch.testing.assert_close(scale, want_scale, rtol=2e-2, atol=0)
    deq = out.float() * (scale[:, None] if scale.dim() == 1 else
                         scale.repeat_interleave(group, 1))
    ref = want.float() * (want_scale[:, None] if want_scale.dim() == 1 else
                          want_scale.repeat_interleave(group, 1))
    assert ((deq - ref).norm() / ref.norm()).item() < 0.05


def test_the_cast_rounds_to_nearest_even(device):
    """Every e4m3 step and the midpoints between them, both signs: the kernel's cast is
    torch's (on the CPU, the interpreter's fallback rounding is)."""
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, -grid, -mids, grid * 0.999, mids * 1.001])
    row = x[None, :].to(device)
    out, scale = _buffers(1, x.numel(), 0, device)
    quantize_fp8(row, out, scale, static=torch.tensor(1.0, device=device))
    assert torch.equal(out.float().cpu()[0], x.to(E4M3).float())


def test_asserts(device):
    x = torch.randn(4, 256, device=device)
    out, scale = _buffers(4, 256, 0, device)
    with pytest.raises(AssertionError, match="e4m3"):
        quantize_fp8(x, out.float(), scale)
    with pytest.raises(AssertionError, match="groups of 128"):
        quantize_fp8(x, out, scale, group=128)
    with pytest.raises(AssertionError, match="static"):
        quantize_fp8(x, out, scale, group=128, static=torch.tensor(1.0))
