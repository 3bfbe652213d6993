"""FP8 (e4m3) projections: the W8A8 scheme and its exact PyTorch reference.

Weights are e4m3 with a scale per output channel (or per 128 × 128 block, as Qwen3's FP8
checkpoints ship them); activations are quantized per token (or per 128-column group with block
weights) at run time; products accumulate in fp32 and are scaled back once. The reference path
below emulates exactly that arithmetic on any device: e4m3 rounding of both operands with the
same scales, an fp32 matmul of the rounded values, the scales applied to the fp32 result.
`Fp8Linear` stands where an `nn.Linear` projection stands; `service.model.layers.linear` calls
it, so the family modules do not change with the precision."""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # the block format's weight tile and activation group
_TINY = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales): x ≈ values * scale, scale = amax / 448 per row, or per
    `group` consecutive columns of a row ((rows, cols / group) scales)."""
    xf = x.float()
    if group is None:
        scale = xf.abs().amax(-1).clamp_min(_TINY) / E4M3_MAX  # (rows,)
        return (xf / scale[:, None]).to(E4M3), scale
    rows, cols = xf.shape
    assert cols % group == 0, f"{cols} columns in groups of {group}"
    g = xf.view(rows, cols // group, group)
    scale = g.abs().amax(-1).clamp_min(_TINY) / E4M3_MAX  # (rows, groups)
    return (g / scale[..., None]).to(E4M3).view(rows, cols), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 (N / block, K / block) scales) of a weight in block × block tiles."""
    n, k = w.shape
    assert n % block == 0 and k % block == 0, f"weight {tuple(w.shape)} in {block}-blocks"
    t = w.float().view(n // block, block, k // block, block)
    scale = t.abs().amax((1, 3)).clamp_min(_TINY) / E4M3_MAX
    return (t / scale[:, None, :, None]).to(E4M3).view(n, k), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values * scale, for per-row (N,), per-group/block (N/b or N, K/b) or scalar scales."""
    v = values.float()
    if scale.dim() == 0 or scale.numel() == 1:
        return v * scale.float().reshape(())
    if scale.dim() == 1:
        return v * scale.float()[:, None]
    rows = v.shape[0] // scale.shape[0]
    cols = v.shape[1] // scale.shape[1]
    return v * scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in e4m3: `weight_scale` (N,) per channel or (N/128, K/128) per
    block; activations quantized per token (per 128-column group with block weights), or with
    one static `input_scale` for the whole tensor."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None):
        super().__init__()
        assert weight.dtype == E4M3 and weight.dim() == 2, f"weight {weight.dtype}"
        n, k = weight.shape
        self.block = weight_scale.dim() == 2
        assert weight_scale.shape == ((n // BLOCK, k // BLOCK) if self.block else (n,)), (
            f"weight_scale {tuple(weight_scale.shape)} for a ({n}, {k}) weight")
        self.in_features, self.out_features = k, n
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.input_scale = (None if input_scale is None
                            else nn.Parameter(input_scale.float().reshape(()),
                                              requires_grad=False))

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Fp8Linear:
        """Per-output-channel e4m3 of a bf16/fp32 projection, per-token dynamic activations."""
        w, scale = quantize_rows(lin.weight.data)
        bias = None if lin.bias is None else lin.bias.data
        return cls(w, scale, bias)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is not None:  # static: values beyond the range saturate at 448
            xs = (x.float() / self.input_scale).clamp(-E4M3_MAX, E4M3_MAX)
            return xs.to(E4M3), self.input_scale
        return quantize_rows(x, BLOCK if self.block else None)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
               accumulate: bool = False, bias: bool = True) -> torch.Tensor:
        """`x @ W^T` (+ bias) into `out`; `accumulate`: out += x @ W^T (no bias)."""
        y = fp8_matmul_ref(x, self)
        if bias and self.bias is not None and not accumulate:
            y = y + self.bias.float()
        if accumulate:
            assert out is not None, "accumulate into an out"
            return out.copy_((out.float() + y).to(out.dtype))
        if out is None:
            return y.to(x.dtype)
        return out.copy_(y.to(out.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def describe(self) -> str:
        acts = "static per tensor" if self.input_scale is not None else (
            "per 128-column group" if self.block else "per token")
        weights = "128x128 block" if self.block else "channel"
        return f"fp8 e4m3, weights per {weights}, activations {acts}"

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 values (tests and folding checks)."""
        return dequantize(self.weight, self.weight_scale)


def fp8_matmul_ref(x: torch.Tensor, lin: Fp8Linear) -> torch.Tensor:
    """fp32 (T, N): both operands rounded to e4m3 with their scales, an fp32 product."""
    xq, xs = lin.quantize_input(x)
    w = dequantize(lin.weight, lin.weight_scale)  # (N, K) fp32
    return dequantize(xq, xs) @ w.t()


PROJECTIONS = ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def precision(model: nn.Module) -> str:
    """"none" when no projection is quantized, else what the quantized ones are."""
    kinds = sorted({m.describe() for m in model.modules() if isinstance(m, Fp8Linear)})
    return "; ".join(kinds) or "none"


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Every layer's projections to per-channel FP8 in place (embedding and LM head stay);
    fold norms first: a folded weight is quantized as the product it is."""
    for layer in model.layers:
        for path in PROJECTIONS:
            owner, _, name = path.rpartition(".")
            parent = layer.get_submodule(owner) if owner else layer
            lin = getattr(parent, name)
            if isinstance(lin, nn.Linear):
                setattr(parent, name, Fp8Linear.from_linear(lin))
