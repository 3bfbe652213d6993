"""The block-scaled FP8 GEMM (kernels/fp8_gemm.py) against its reference: 128 x 128 weight
tiles, 128-column activation groups, bias, ragged rows."""

import pytest
import torch

from kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from kernels.quant_fp8 import quantize_ref
from service.model.quant.fp8_linear import quantize_blocks

SMALL = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=2)


def _operands(M: int, N: int, K: int, device: str):
    x, w = torch.randn(M, K), torch.randn(N, K) / K**0.5
    x[:, : K // 4] *= 20  # groups whose scales differ
    w[: N // 2] *= 3  # and weight tiles
    return [t.to(device) for t in (*quantize_ref(x, 128), *quantize_blocks(w))]


@pytest.mark.parametrize("M,N,K,bias", [
    (5, 256, 384, True),
    (70, 384, 256, False),  # ragged rows
    (3, 128, 512, True),
    (300, 1024, 2048, False),
])
def test_gemm_matches_the_reference(M, N, K, bias, device):
    """fp32 out, so only the sums differ. NOTE: on Hopper each 128-deep FP8 MMA accumulates
    at reduced precision before the fp32 add; the CPU (interpreter, fp32 dots) is exact."""
    a, sa, w, sw = _operands(M, N, K, device)
    if M % 2:
        sa = sa.t().contiguous().t()  # column-major groups, as the service writes them
    b = torch.randn(N).to(torch.bfloat16).to(device) if bias else None
    out, want = torch.empty(M, N, device=device), torch.empty(M, N, device=device)
    fp8_gemm(a, sa, w, sw, out, b, config=None if device == "cuda" else SMALL)
    fp8_gemm_ref(a, sa, w, sw, want, b)
    err = ((out - want).norm() / want.norm()).item()
    assert err < (1e-3 if device == "cuda" else 1e-6), err


@pytest.mark.gpu
def test_cublas_block_scaled_gemm_agrees():
    """torch._scaled_mm with the same block scales (what Fp8Linear runs when this torch has
    it) against the reference: the same reduced-precision partial sums, bf16 out."""
    from service.model.quant.fp8_linear import cublas_block_scales

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not cublas_block_scales(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("this torch's _scaled_mm takes no block scales")
    a, sa, w, sw = _operands(320, 1024, 2048, "cuda")
    got = torch._scaled_mm(a, w.t(), scale_a=sa.t().contiguous().t(), scale_b=sw.t(),
                           out_dtype=torch.bfloat16)
    want = fp8_gemm_ref(a, sa, w, sw, torch.empty(320, 1024, device="cuda"))
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3


def test_asserts(device):
    a, sa, w, sw = _operands(4, 128, 256, device)
    out = torch.empty(4, 128, device=device)
    with pytest.raises(AssertionError, match="e4m3"):
        fp8_gemm(a.float(), sa, w, sw, out)
    with pytest.raises(AssertionError, match="block scales"):
        fp8_gemm(a, sa[:, :1], w, sw, out)
    with pytest.raises(AssertionError, match="scale group"):
        fp8_gemm(a, sa, w, sw, out, config=dict(SMALL, BLOCK_K=64))
