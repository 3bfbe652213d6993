"""norm_linear (add + RMSNorm + linear + RoPE | SiLU-and-mul in one kernel) against its reference,
the unfused chain; bf16 both against the fp32 chain."""

import pytest
import torch
from conftest import INTERPRET

from kernels.norm_linear import Tiles, norm_linear, norm_linear_ref
from kernels.rope import rope_cos_sin_cache

SMALL = Tiles(16, 16, 32, 4, 1)  # the interpreter's cost grows with the tile


def _case(m, k, n, dtype, device, bias):
    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape)).to(dtype).to(device)

    return dict(x=rnd(m, k), r=rnd(m, k), g=(1 + rnd(k, scale=0.1)).to(dtype),
                w=rnd(n, k, scale=k**-0.5), b=rnd(n) if bias else None)


def _run(fn, c, residual: bool, out_cols: int, **kw):
    x, r = c["x"], c["r"]
    dt = torch.float32 if fn is norm_linear_ref and kw.pop("fp32", False) else x.dtype
    cast = (lambda t: None if t is None else t.to(dt))
    out = torch.full((x.shape[0], out_cols), float("nan"), dtype=dt, device=x.device)
    r_out = torch.full(x.shape, float("nan"), dtype=dt, device=x.device)
    fn(cast(x), cast(r) if residual else None, r_out if residual else None, cast(c["g"]), 1e-6,
       cast(c["w"]), cast(c["b"]), out, **kw)
    return out, r_out


@pytest.mark.parametrize("m,k,heads,kvh,d,bias,residual", [
    (7, 96, 3, 1, 32, False, True),  # GQA 3, odd rows
    (70, 64, 2, 2, 16, True, False),  # Qwen-style bias, no residual (the first layer)
    (33, 80, 4, 2, 32, True, True),  # K not a multiple of the K tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_epilogue(m, k, heads, kvh, d, bias, residual, dtype, device, close):
    n = (heads + 2 * kvh) * d
    c = _case(m, k, n, dtype, device, bias)
    kw = dict(epilogue="rope", positions=torch.randint(0, 500, (m,), device=device),
              cos_sin=rope_cos_sin_cache(d, 512, 10000.0, None).to(device),
              rope_cols=(heads + kvh) * d, head_dim=d)
    out, r_out = _run(norm_linear, c, residual, n, tiles=SMALL, **kw)
    truth, _ = _run(norm_linear_ref, c, residual, n, fp32=True, **kw)
    ref, r_ref = _run(norm_linear_ref, c, residual, n, **kw)
    close(out.float(), truth, dtype, "fused vs fp32 chain")
    close(ref.float(), truth, dtype, "unfused vs fp32 chain")
    if residual:
        _check_residual(r_out, r_ref, dtype)


@pytest.mark.parametrize("m,k,f,residual", [(5, 64, 48, True), (40, 112, 96, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_epilogue(m, k, f, residual, dtype, device, close):
    c = _case(m, k, 2 * f, dtype, device, False)
    out, r_out = _run(norm_linear, c, residual, f, tiles=SMALL, epilogue="silu")
    truth, _ = _run(norm_linear_ref, c, residual, f, fp32=True, epilogue="silu")
    ref, r_ref = _run(norm_linear_ref, c, residual, f, epilogue="silu")
    close(out.float(), truth, dtype, "fused vs fp32 chain")
    close(ref.float(), truth, dtype, "unfused vs fp32 chain")
    if residual:
        _check_residual(r_out, r_ref, dtype)


def _check_residual(got, ref, dtype):
    """x + residual rounded to the dtype: exact on the GPU; the interpreter's fp32 -> bf16 cast
    may truncate instead of rounding, one step off."""
    assert torch.isfinite(got).all(), "residual_out not fully written"
    if INTERPRET and dtype == torch.bfloat16:
        step = ref.float().abs() * 2**-7
        assert ((got.float() - ref.float()).abs() <= step).all()
    else:
        assert torch.equal(got, ref)


def test_asserts(device):
    x = torch.randn(4, 32, device=device)
    g, w = torch.ones(32, device=device), torch.randn(64, 32, device=device)
    out = torch.empty(4, 64, device=device)
    with pytest.raises(AssertionError, match="alias"):
        norm_linear(x, x.clone(), x, g, 1e-6, w, None, out)
    with pytest.raises(AssertionError, match="epilogue"):
        norm_linear(x, None, None, g, 1e-6, w, None, out, epilogue="gelu")
    with pytest.raises(AssertionError, match="positions"):
        norm_linear(x, None, None, g, 1e-6, w, None, out, epilogue="rope", head_dim=16,
                    rope_cols=32)
    with pytest.raises(AssertionError, match="no bias"):
        norm_linear(x, None, None, g, 1e-6, w, torch.zeros(64, device=device),
                    torch.empty(4, 32, device=device), epilogue="silu")
