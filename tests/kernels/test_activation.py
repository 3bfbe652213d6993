"""silu_and_mul (Triton) against silu_and_mul_ref."""

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize(
    "T,F,dtype,block_f",
    [
        (1, 1536, torch.float32, 1024),
        (7, 2048, torch.bfloat16, 512),
        (5, 100, torch.float16, 64),
        (3, 14336, torch.bfloat16, 4096),
    ],
)
def test_silu_and_mul(T, F, dtype, block_f, device, close):
    x = (3 * torch.randn((T, 2 * F + 16))).to(dtype)[:, 16:]  # strided rows
    out = torch.full((T, F), float("nan"), dtype=dtype, device=device)
    got = silu_and_mul(x.to(device), out=out, block_f=block_f)
    assert got.data_ptr() == out.data_ptr()
    ref = torch.nn.functional.silu(x[:, :F].double()) * x[:, F:].double()
    close(got.cpu().double(), ref, dtype, "silu_and_mul")
    close(silu_and_mul_ref(x).double(), ref, dtype, "ref")


def test_asserts(device):
    with pytest.raises(AssertionError, match="2F"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(AssertionError, match="contiguous"):
        silu_and_mul(torch.randn(8, 2, device=device).t())


@pytest.mark.parametrize("T,F,D,dtype,block_f", [
    (5, 1536, 576, torch.bfloat16, 1024),
    (3, 100, 72, torch.float32, 1024),
    (1030, 300, 40, torch.float32, 64),  # >= 1,024 rows: 4 column blocks a program, 5 in all
])
def test_silu_and_mul_folded_norm(T, F, D, dtype, block_f, device, close):
    """With norm_rows, gate and up are scaled by each row's 1/rms first: the activation of
    rms_norm(h) @ W_gu^T computed from h @ (W_gu * g)^T (the norm weight folded in)."""
    eps = 1e-5
    h = (4 * torch.randn(T, D)).to(dtype)
    g = (1 + 0.5 * torch.randn(D)).to(dtype)
    w = torch.randn(2 * F, D).to(dtype) / D**0.5
    raw = (h.float() @ (w.float() * g.float()).t()).to(dtype)  # the folded GEMM's output
    got = silu_and_mul(raw.to(device), norm_rows=h.to(device), eps=eps, block_f=block_f)
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
    gu = (normed * g.double()) @ w.double().t()
    want = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    close(got.cpu().double(), want, dtype, "folded")
    close(silu_and_mul_ref(raw, norm_rows=h, eps=eps).double(), want, dtype, "ref")
