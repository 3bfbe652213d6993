"""act_and_mul (Triton, SiLU and GeLU-tanh) against act_and_mul_ref and torch's activations."""

import pytest
import torch

from kernels.activation import act_and_mul, act_and_mul_ref

GELU = torch.nn.functional.gelu


@pytest.mark.parametrize(
    "T,F,dtype,block_f",
    [
        (1, 1536, torch.float32, 1024),
        (7, 2048, torch.bfloat16, 512),
        (5, 100, torch.float16, 64),
        (3, 14336, torch.bfloat16, 4096),
    ],
)
def test_act_and_mul_silu(T, F, dtype, block_f, device, close):
    x = (3 * torch.randn((T, 2 * F + 16))).to(dtype)[:, 16:]  # strided rows
    out = torch.full((T, F), float("nan"), dtype=dtype, device=device)
    got = act_and_mul(x.to(device), out=out, block_f=block_f)
    assert got.data_ptr() == out.data_ptr()
    ref = torch.nn.functional.silu(x[:, :F].double()) * x[:, F:].double()
    close(got.cpu().double(), ref, dtype, "silu")
    close(act_and_mul_ref(x).double(), ref, dtype, "ref")


def test_asserts(device):
    with pytest.raises(AssertionError, match="2F"):
        act_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(AssertionError, match="contiguous"):
        act_and_mul(torch.randn(8, 2, device=device).t())


@pytest.mark.parametrize("T,F,D,dtype,block_f", [
    (5, 1536, 576, torch.bfloat16, 1024),
    (3, 100, 72, torch.float32, 1024),
    (1030, 300, 40, torch.float32, 64),  # >= 1,024 rows: 4 column blocks a program, 5 in all
])
def test_act_and_mul_silu_folded_norm(T, F, D, dtype, block_f, device, close):
    """With norm_rows, gate and up are scaled by each row's 1/rms first: the activation of
    rms_norm(h) @ W_gu^T computed from h @ (W_gu * g)^T (the norm weight folded in)."""
    eps = 1e-5
    h = (4 * torch.randn(T, D)).to(dtype)
    g = (1 + 0.5 * torch.randn(D)).to(dtype)
    w = torch.randn(2 * F, D).to(dtype) / D**0.5
    raw = (h.float() @ (w.float() * g.float()).t()).to(dtype)  # the folded GEMM's output
    got = act_and_mul(raw.to(device), norm_rows=h.to(device), eps=eps, block_f=block_f)
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
    gu = (normed * g.double()) @ w.double().t()
    want = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    close(got.cpu().double(), want, dtype, "folded")
    close(act_and_mul_ref(raw, norm_rows=h, eps=eps).double(), want, dtype, "ref")


@pytest.mark.parametrize("T,F,dtype,block_f", [
    (3, 1536, torch.float32, 1024),
    (7, 100, torch.bfloat16, 64),
    (2, 2048, torch.float16, 512),
])
# the interpreter's exp overflows to inf on very negative gates, as the GPU's: sigmoid -> 0
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_act_and_mul_gelu_tanh(T, F, dtype, block_f, device, close):
    """Gemma's gelu_pytorch_tanh(gate) * up, gates out to +-30 where tanh saturates."""
    x = (5 * torch.randn((T, 2 * F + 16))).to(dtype)[:, 16:]  # strided rows
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, 1e-6]).to(dtype)
    out = torch.full((T, F), float("nan"), dtype=dtype, device=device)
    got = act_and_mul(x.to(device), out=out, activation="gelu_tanh", block_f=block_f)
    assert got.data_ptr() == out.data_ptr()
    ref = GELU(x[:, :F].double(), approximate="tanh") * x[:, F:].double()
    close(got.cpu().double(), ref, dtype, "gelu_tanh")
    close(act_and_mul_ref(x, activation="gelu_tanh").double(), ref, dtype, "ref")
    if dtype == torch.float32:  # elementwise too: the saturated and tiny gates included
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,F,D,dtype", [
    (5, 1536, 576, torch.bfloat16),
    (3, 100, 72, torch.float32),
])
def test_act_and_mul_gelu_tanh_folded_norm(T, F, D, dtype, device, close):
    """gelu_tanh over rms_norm(h) @ W_gu^T computed from h @ (W_gu * g)^T, as for SiLU."""
    eps = 1e-6
    h = (4 * torch.randn(T, D)).to(dtype)
    g = (1 + 0.5 * torch.randn(D)).to(dtype)
    w = torch.randn(2 * F, D).to(dtype) / D**0.5
    raw = (h.float() @ (w.float() * g.float()).t()).to(dtype)
    got = act_and_mul(raw.to(device), activation="gelu_tanh", norm_rows=h.to(device), eps=eps)
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
    gu = (normed * g.double()) @ w.double().t()
    want = GELU(gu[:, :F], approximate="tanh") * gu[:, F:]
    close(got.cpu().double(), want, dtype, "folded")
    ref = act_and_mul_ref(raw, activation="gelu_tanh", norm_rows=h, eps=eps)
    close(ref.double(), want, dtype, "ref")


def test_unknown_activation(device):
    with pytest.raises(AssertionError, match="relu"):
        act_and_mul(torch.randn(2, 8, device=device), activation="relu")
