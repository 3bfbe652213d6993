"""FP8 projections: the e4m3 scheme's reference arithmetic, and a model with quantized layers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kernels.quant_fp8 import E4M3, E4M3_MAX, dequantize, quantize_ref
from service.model.quant.fp8 import quantize_model
from service.model.quant.fp8_linear import Fp8Linear, quantize_blocks
from tests.engine.helpers import tiny_model
from tests.model.prefill import Prefiller


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def test_rows_scale_to_the_e4m3_range():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    q, s = quantize_ref(x)
    assert q.dtype == E4M3 and s.shape == (5,)
    assert torch.equal(q.float().abs().amax(-1)[:4], torch.full((4,), E4M3_MAX))
    back = dequantize(q, s)
    assert torch.equal(back[4], torch.zeros(64))  # an all-zero row stays zero
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value above the subnormal range
    big = x[:4].abs() >= s[:4, None] * 2**-6
    assert ((back[:4] - x[:4]).abs() <= x[:4].abs() * 2**-4 + 1e-12)[big].all()


def test_groups_and_blocks_have_their_own_scales():
    x = torch.randn(3, 256)
    x[:, 128:] *= 100
    q, s = quantize_ref(x, 128)
    assert s.shape == (3, 2) and (s[:, 1] > 50 * s[:, 0]).all()
    w = torch.randn(256, 384)
    wq, ws = quantize_blocks(w)
    assert ws.shape == (2, 3)
    want = torch.stack([torch.stack([w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
                                     for j in range(3)]) for i in range(2)]) / E4M3_MAX
    assert torch.allclose(ws, want)
    assert torch.equal(dequantize(wq, ws)[:128, :128], wq[:128, :128].float() * ws[0, 0])


@pytest.mark.parametrize("bias", [False, True])
def test_per_channel_projection_is_the_emulated_product(bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias)
    x = torch.randn(9, 64)
    f = Fp8Linear.from_linear(lin)
    sw = lin.weight.detach().abs().amax(-1) / E4M3_MAX
    sx = x.abs().amax(-1) / E4M3_MAX
    want = (_e4m3(x / sx[:, None]) * sx[:, None]) @ (
        _e4m3(lin.weight.detach() / sw[:, None]) * sw[:, None]).t()
    if bias:
        want = want + lin.bias.detach()
    torch.testing.assert_close(f.matmul(x), want, rtol=1e-6, atol=1e-6)
    out = torch.ones(9, 48)
    with pytest.raises(AssertionError, match="unfolded"):  # no folded-norm out +=
        f.matmul(x, out, accumulate=True)
    err = (f.matmul(x) - lin(x)).norm() / lin(x).norm()
    assert 0 < err < 0.06


def test_block_projection_quantizes_activations_per_group():
    torch.manual_seed(1)
    w, x = torch.randn(256, 256) * 0.05, torch.randn(4, 256)
    f = Fp8Linear(*quantize_blocks(w))
    xq, xs = quantize_ref(x, 128)
    want = dequantize(xq, xs) @ dequantize(*quantize_blocks(w)).t()
    assert torch.equal(f.matmul(x), want)


def test_static_input_scale_saturates():
    lin = nn.Linear(8, 4, bias=False)
    f = Fp8Linear(*quantize_ref(lin.weight.detach()), input_scale=torch.tensor(0.01))
    x = torch.full((1, 8), 100.0)  # 100 / 0.01 = 10,000: past e4m3's 448
    q = f.quantize(x)
    assert torch.equal(q.values.float(), torch.full((1, 8), E4M3_MAX))
    assert q.scale.tolist() == [pytest.approx(0.01)]  # the static scale, a copy per row


def test_a_quantized_model_runs_and_stays_close():
    """The pre-norms' weights are quantized inside QKV and gate/up; the norms still run (unit
    weights, not `folded`: their launch quantizes); folding afterwards leaves the model alone,
    and quantizing a folded model is refused."""
    model = tiny_model(num_layers=2, seed=3)
    for layer in model.layers:  # norm weights that differ per channel
        layer.attn_norm.weight.data.uniform_(0.5, 2.0)
    ids = [list(range(1, 40)), list(range(50, 60))]
    want = Prefiller(model).last_logits(ids)
    fp8 = copy.deepcopy(model)
    weights = [layer.qkv_proj.weight.detach() * layer.attn_norm.weight.detach()[None, :]
               for layer in fp8.layers]
    quantize_model(fp8)
    assert fp8.quantized and not model.quantized
    for layer, w in zip(fp8.layers, weights):
        assert isinstance(layer.qkv_proj, Fp8Linear) and isinstance(layer.mlp.down_proj,
                                                                    Fp8Linear)
        assert not layer.folded and torch.equal(layer.attn_norm.weight,
                                                torch.ones_like(layer.attn_norm.weight))
        torch.testing.assert_close(layer.qkv_proj.dequantized(), w, rtol=2**-4, atol=1e-6)
    before = [p.detach().clone() for p in fp8.parameters()]
    fp8.fold_norms()  # a quantized model does not fold
    assert not fp8.norms_folded
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, fp8.parameters()))
    got = Prefiller(fp8).last_logits(ids)
    for g, w in zip(got, want):
        assert 0 < ((g - w).norm() / w.norm()).item() < 0.05
    folded = copy.deepcopy(model)
    folded.fold_norms()
    with pytest.raises(AssertionError, match="before folding"):
        quantize_model(folded)
