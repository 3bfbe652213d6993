"""norm_qkv_rope / norm_gate_up_silu (Triton) against the unfused chain in float64: RMSNorm
with its weight, the projection (+ bias), then RoPE or SiLU-and-mul."""

import pytest
import torch

from kernels.norm_linear import (
    norm_gate_up_silu,
    norm_gate_up_silu_ref,
    norm_qkv_rope,
    norm_qkv_rope_ref,
)
from kernels.rope import apply_rope_ref, rope_cos_sin_cache

EPS = 1e-5


def rms_normed(x, g):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


@pytest.mark.parametrize("M,H,KVH,D,K,dtype,bias", [
    (5, 9, 3, 64, 576, torch.bfloat16, False),  # SmolLM2's heads
    (70, 4, 2, 80, 100, torch.float32, True),  # partial row tiles, head_dim not a power of 2
    (3, 2, 1, 128, 72, torch.bfloat16, True),
])
def test_norm_qkv_rope_matches_the_unfused_chain(M, H, KVH, D, K, dtype, bias, device, close):
    n = (H + 2 * KVH) * D
    x = (3 * torch.randn(M + 2, K)).to(dtype)[1:M + 1]  # strided rows
    g = torch.rand(K) + 0.5
    w = torch.randn(n, K) / K**0.5
    b = torch.randn(n).to(dtype) if bias else None
    folded = (w * g).to(dtype)
    cache = rope_cos_sin_cache(D, 256, 10000.0)
    pos = torch.randint(0, 256, (M,))
    want = rms_normed(x, g) @ w.to(dtype).double().t()
    if bias:
        want += b.double()
    apply_rope_ref(want[:, :H * D].view(M, H, D), want[:, H * D:(H + KVH) * D].view(M, KVH, D),
                   pos, cache)
    out = torch.full((M, n), float("nan"), dtype=dtype, device=device)
    got = norm_qkv_rope(x.to(device), folded.to(device), None if b is None else b.to(device),
                        pos.to(device), cache.to(device), EPS, H, KVH, out)
    assert got.data_ptr() == out.data_ptr()
    close(got.cpu().double(), want, dtype, "fused")
    close(norm_qkv_rope_ref(x, folded, b, pos, cache, EPS, H, KVH).double(), want, dtype, "ref")


@pytest.mark.parametrize("M,F,K,dtype", [(5, 1536, 576, torch.bfloat16),
                                         (70, 100, 72, torch.float32)])
def test_norm_gate_up_silu_matches_the_unfused_chain(M, F, K, dtype, device, close):
    x = (3 * torch.randn(M, K)).to(dtype)
    g = torch.rand(K) + 0.5
    w = torch.randn(2 * F, K) / K**0.5
    folded = (w * g).to(dtype)
    gu = rms_normed(x, g) @ w.to(dtype).double().t()
    want = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    scratch = torch.full((M, 2 * F), float("nan"), dtype=dtype, device=device)
    got = norm_gate_up_silu(x.to(device), folded.to(device), EPS, out=scratch[:, :F])
    close(got.cpu().double(), want, dtype, "fused")  # into a strided out, as the runner does
    close(norm_gate_up_silu_ref(x, folded, EPS).double(), want, dtype, "ref")


def test_asserts(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(AssertionError, match="columns"):
        norm_qkv_rope(x, torch.randn(30, 8, device=device), None, torch.zeros(4, dtype=torch.long,
                      device=device), torch.zeros(8, 4, device=device), EPS, 2, 1)
    with pytest.raises(AssertionError, match="contiguous"):
        norm_gate_up_silu(x, torch.randn(8, 16, device=device).t(), EPS)
