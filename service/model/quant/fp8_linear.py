"""FP8 W8A8 projections: fp32 sums; cuBLASLt or Triton GEMMs on CUDA, exact emulation elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops
from kernels.fp8_gemm import SCALE_BLOCK, fp8_gemm, fp8_gemm_ref
from kernels.quant_fp8 import E4M3, E4M3_MAX, TINY, dequantize, quantize_ref

BLOCK = SCALE_BLOCK  # the block format's weight tile and activation group


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    assert n % block == 0 and k % block == 0, f"weight {tuple(w.shape)} in {block}-blocks"
    t = w.float().view(n // block, block, k // block, block)
    scale = t.abs().amax((1, 3)).clamp_min(TINY) / E4M3_MAX
    return (t / scale[:, None, :, None]).to(E4M3).view(n, k), scale


@dataclass(frozen=True)
class QuantizedRows:
    """An FP8 GEMM's input: e4m3 rows, fp32 scales ((T,) or (T, K / 128)), the output's dtype."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, rows: slice) -> QuantizedRows:
        return QuantizedRows(self.values[rows], self.scale[rows], self.dtype)


@dataclass(frozen=True)
class Fp8Scratch:
    """Flat e4m3 values and fp32 scales for quantized rows; a graph runner sizes it once."""

    values: torch.Tensor  # (>= rows * cols,) e4m3
    scale: torch.Tensor  # (>= rows * groups,) fp32

    @classmethod
    def allocate(cls, rows: int, cols: int, device: torch.device | str) -> Fp8Scratch:
        groups = max(1, -(-cols // BLOCK))
        return cls(torch.zeros(rows * cols, dtype=E4M3, device=device),
                   torch.zeros(rows * groups, dtype=torch.float32, device=device))

    def take(self, rows: int, cols: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows * (cols // group if group else 1)
        assert rows * cols <= self.values.numel() and n <= self.scale.numel(), (
            f"({rows}, {cols}) rows past the FP8 scratch")
        return self.values[: rows * cols].view(rows, cols), _scales(self.scale[:n], rows, group)

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 4 * self.scale.numel()


def _scales(flat: torch.Tensor, rows: int, group: int) -> torch.Tensor:
    """(rows,), or (rows, groups) column-major: the layout cuBLASLt's block-scaled GEMM reads."""
    return flat.view(-1, rows).t() if group else flat


def _empty(rows: int, cols: int, group: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows * (cols // group if group else 1)
    return (torch.empty(rows, cols, dtype=E4M3, device=device),
            _scales(torch.empty(n, dtype=torch.float32, device=device), rows, group))


_CUBLAS_BLOCK: dict[torch.device, bool] = {}


def cublas_block_scales(device: torch.device) -> bool:
    """Whether `_scaled_mm` takes 128 x 128 block scales (CUDA 12.9+); a captured first call: no."""
    if device in _CUBLAS_BLOCK:
        return _CUBLAS_BLOCK[device]
    if torch.cuda.is_current_stream_capturing():
        return False
    a = torch.zeros(2 * BLOCK, 2 * BLOCK, dtype=E4M3, device=device)
    s = torch.ones(2, 2 * BLOCK, device=device).t()  # (256, 2) column-major: 1 x 128 groups
    try:
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=torch.ones(2, 2, device=device).t(),
                         out_dtype=torch.bfloat16)
        ok = True
    except (RuntimeError, ValueError):
        ok = False
    _CUBLAS_BLOCK[device] = ok
    return ok


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ b), e4m3 W scaled (N,) or (N/128, K/128); activations per token, per group
    with block weights, or by one static `input_scale`. `use_triton` None: by the input's device."""

    foldable = False  # an e4m3 weight times a norm weight is no longer e4m3

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
        self.group = BLOCK if self.block else 0
        self.use_triton: bool | None = None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Fp8Linear:
        w, scale = quantize_ref(lin.weight.data)
        bias = None if lin.bias is None else lin.bias.data
        return cls(w, scale, bias)

    def _triton(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.use_triton is None else self.use_triton

    def _input_buffers(self, rows: int, cols: int, device: torch.device,
                 scratch: Fp8Scratch | None) -> tuple[torch.Tensor, torch.Tensor]:
        if scratch is None:
            return _empty(rows, cols, self.group, device)
        return scratch.take(rows, cols, self.group)

    def quantize(self, x: torch.Tensor, scratch: Fp8Scratch | None = None, *,
                 residual: torch.Tensor | None = None, norm: nn.Module | None = None
                 ) -> QuantizedRows:
        """x's rows as this projection reads them; with `residual` (+= x) and `norm`, normed."""
        values, scale = self._input_buffers(x.shape[0], self.in_features, x.device, scratch)
        ops.quantize_fp8(x, values, scale, group=self.group, static=self.input_scale,
                         residual=residual, weight=None if norm is None else norm.weight,
                         eps=0.0 if norm is None else norm.eps, use_triton=self._triton(x))
        return QuantizedRows(values, scale, x.dtype)

    def quantize_act(self, gate_up: torch.Tensor, activation: str,
                     scratch: Fp8Scratch | None = None) -> QuantizedRows:
        values, scale = self._input_buffers(gate_up.shape[0], self.in_features, gate_up.device,
                                      scratch)
        ops.act_and_mul_fp8(gate_up, values, scale, activation=activation, group=self.group,
                            static=self.input_scale, use_triton=self._triton(gate_up))
        return QuantizedRows(values, scale, gate_up.dtype)

    def normed(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, scratch: Fp8Scratch | None = None
               ) -> QuantizedRows:
        """The norm's rows quantized by its own launch (x is left as it was)."""
        return self.quantize(x, scratch, residual=residual, norm=norm)

    def gated(self, gate_up: torch.Tensor, activation: str, scratch: Fp8Scratch | None = None,
              *, use_triton: bool = False, norm_rows: torch.Tensor | None = None,
              eps: float = 0.0) -> QuantizedRows:
        assert norm_rows is None, "quantized projections run with their norms unfolded"
        return self.quantize_act(gate_up, activation, scratch)

    def fold_norm(self, weight: torch.Tensor) -> None:
        raise AssertionError("norms fold into unquantized projections only")

    def matmul(self, x: torch.Tensor | QuantizedRows, out: torch.Tensor | None = None, *,
               accumulate: bool = False, bias: bool = True,
               scratch: Fp8Scratch | None = None) -> torch.Tensor:
        """`x @ W^T` (+ bias) into `out`; x: rows to quantize (into `scratch`) or quantized ones."""
        assert not accumulate, "quantized projections run with their norms unfolded"
        q = x if isinstance(x, QuantizedRows) else self.quantize(x, scratch)
        b = self.bias if bias else None
        if out is None:
            out = torch.empty(q.shape[0], self.out_features, dtype=q.dtype,
                              device=q.values.device)
        if not self._triton(q.values):
            return fp8_gemm_ref(q.values, q.scale, self.weight, self.weight_scale, out, b)
        # cuBLASLt has no block-scaled algorithm for some row counts; whole 16-row tiles it takes.
        # Captured into a CUDA graph its block-scaled GEMM replays wrong (torch 2.11): Triton's.
        if self.block and (out.shape[0] % 16 or torch.cuda.is_current_stream_capturing()
                           or not cublas_block_scales(out.device)):
            return fp8_gemm(q.values, q.scale, self.weight, self.weight_scale, out, b)
        if self.block:  # cuBLASLt: 1 x 128 activation groups, 128 x 128 weight tiles
            return torch._scaled_mm(q.values, self.weight.t(), scale_a=q.scale,
                                    scale_b=self.weight_scale.t(), bias=b, out_dtype=out.dtype,
                                    out=out)
        return torch._scaled_mm(q.values, self.weight.t(), scale_a=q.scale[:, None],
                                scale_b=self.weight_scale[None, :], bias=b, out_dtype=out.dtype,
                                out=out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale)
