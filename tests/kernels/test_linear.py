"""indexed_linear (Triton) against its reference: the layer picked from a device scalar."""

import pytest
import torch

from kernels.linear import indexed_linear, indexed_linear_ref, pick_tiles

# (M, N, K, layers): awkward sizes that leave partial tiles in every dimension
CASES = [(1, 24, 40, 3), (7, 48, 32, 2), (33, 20, 72, 4), (17, 64, 100, 3)]


@pytest.mark.parametrize("M,N,K,L", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_indexed_linear_picks_the_layer_on_the_device(M, N, K, L, dtype, bias, device, close):
    x = torch.randn(M, K + 8).to(dtype)[:, 4: K + 4]  # strided rows, as the in-place SiLU's
    w = torch.randn(L, N, K).to(dtype) / K**0.5
    b = torch.randn(L, N).to(dtype) if bias else None
    for layer, offset in ((0, 0), (L - 2, 1), (L - 1, 0)):
        idx = torch.tensor([layer], dtype=torch.int32)
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        got = indexed_linear(x.to(device), w.to(device), None if b is None else b.to(device),
                             idx.to(device), offset, out)
        i = layer + offset
        want = x.float() @ w[i].float().t() + (b[i].float() if b is not None else 0)
        close(got.cpu().float(), want, dtype, f"layer {i}")
        ref = indexed_linear_ref(x, w, b, idx, offset)
        close(ref.float(), want, dtype, f"reference, layer {i}")


def test_indexed_linear_asserts(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(2, 6, 8, device=device)
    with pytest.raises(AssertionError, match="int32"):
        indexed_linear(x, w, None, torch.zeros(1, dtype=torch.int64, device=device))
    with pytest.raises(AssertionError, match="stack"):
        indexed_linear(x, w[0], None, torch.zeros(1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("M,N", [(16, 576), (16, 3072), (256, 960), (8, 2048), (512, 16384)])
def test_pick_tiles_fills_the_gpu_or_uses_the_narrowest_tile(M, N):
    bm, bn, bk, warps, stages = pick_tiles(M, N, 576, sms=132)
    assert 16 <= bm <= 64 and bm >= min(M, 64) and bn in (32, 64, 128)
    programs = -(-N // bn) * -(-M // bm)
    assert programs >= 132 or bn == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_linear_accumulates_into_out(dtype, device, close):
    """accumulate=True is out += x @ W[layer]^T (the residual add of a folded-norm layer)."""
    M, N, K, L = 17, 48, 40, 3
    x = torch.randn(M, K).to(dtype)
    w = torch.randn(L, N, K).to(dtype) / K**0.5
    base = torch.randn(M, N).to(dtype)
    idx = torch.tensor([1], dtype=torch.int32)
    out = base.to(device, copy=True)
    got = indexed_linear(x.to(device), w.to(device), None, idx.to(device), 1, out,
                         accumulate=True)
    assert got.data_ptr() == out.data_ptr()
    want = base.float() + x.float() @ w[2].float().t()
    close(got.cpu().float(), want, dtype, "accumulate")
    close(indexed_linear_ref(x, w, None, idx, 1, base.clone(), accumulate=True).float(), want,
          dtype, "reference")
