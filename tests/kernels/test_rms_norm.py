"""rms_norm / fused_add_rms_norm (Triton) against their references."""

import pytest
import torch

from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

CASES = [
    (1, 576, torch.float32),
    (7, 896, torch.bfloat16),
    (5, 2048, torch.float16),
    (3, 4096, torch.bfloat16),
    (4, 100, torch.float32),
]


@pytest.mark.parametrize("T,N,dtype", CASES)
def test_rms_norm(T, N, dtype, device, close):
    x = torch.randn((T, N + 8)).to(dtype)[:, 3 : N + 3]  # a strided row view
    w = (1 + 0.1 * torch.randn(N)).to(dtype)
    out = torch.full((T, N), float("nan"), dtype=dtype)
    got = rms_norm(x.to(device), w.to(device), 1e-6, out=out.to(device))
    close(got.cpu().float(), rms_norm_ref(x.float(), w.float(), 1e-6), dtype, "rms_norm")
    close(got.cpu().float(), rms_norm_ref(x, w, 1e-6).float(), dtype, "rms_norm, same dtype")


@pytest.mark.parametrize("T,N,dtype", CASES)
def test_fused_add_rms_norm(T, N, dtype, device, close):
    x = torch.randn((T, N)).to(dtype)
    res = torch.randn((T, N)).to(dtype)
    w = torch.randn(N).to(dtype)
    xd, rd = x.to(device, copy=True), res.to(device, copy=True)
    got_x, got_r = fused_add_rms_norm(xd, rd, w.to(device), 1e-5)
    assert got_x.data_ptr() == xd.data_ptr() and got_r.data_ptr() == rd.data_ptr(), "in place"
    ref_x, ref_r = fused_add_rms_norm_ref(x.clone(), res.clone(), w, 1e-5)
    if device == "cuda":  # NOTE: the interpreter truncates fp32 -> bf16 instead of rounding
        assert torch.equal(got_r.cpu(), ref_r), "residual must be x + residual in the input dtype"
    close(got_r.cpu().float(), ref_r.float(), dtype, "residual")
    close(got_x.cpu().float(), ref_x.float(), dtype, "x")


def test_asserts(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(AssertionError, match="contiguous"):
        rms_norm(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(AssertionError, match="dtype"):
        rms_norm(x.to(torch.int32), torch.ones(64, device=device), 1e-6)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, torch.ones(63, device=device), 1e-6)
