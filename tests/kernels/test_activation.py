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
