"""The decoder's building blocks: RMSNorm, projections into given buffers, and the gated MLP.

Optional `out`/`scratch`/`q8` buffers let a captured graph step allocate nothing. A quantized
projection (service/model/fp8.py) reads its input quantized: the norm or activation before it
writes e4m3 rows in the same launch (`normed_input`, `gated_mlp`)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from service.model.fp8 import Fp8Scratch, QuantizedRows

MLP_ROW_ALIGN = 16  # MLP row chunks are multiples of this: whole GEMM row tiles


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_triton = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        """rms_norm(x) (into `out`), or with `residual`: in place, returns (x, residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, out=out, use_triton=self.use_triton)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps,
                                      use_triton=self.use_triton)


def linear(x: torch.Tensor | QuantizedRows, lin: nn.Module, out: torch.Tensor | None = None, *,
           accumulate: bool = False, bias: bool = True,
           q8: Fp8Scratch | None = None) -> torch.Tensor:
    """`lin(x)`, optionally into `out`; `accumulate`: out += x @ W^T (no bias). `lin` is an
    nn.Linear or a quantized projection with the same `matmul` contract (service/model/fp8.py),
    which quantizes x into `q8` unless x comes quantized."""
    if not isinstance(lin, nn.Linear):
        return lin.matmul(x, out, accumulate=accumulate, bias=bias, scratch=q8)
    if accumulate:
        assert out is not None and lin.bias is None, "accumulate into an out, without a bias"
        return out.addmm_(x, lin.weight.t())
    b = lin.bias if bias else None
    if out is None:
        return torch.nn.functional.linear(x, lin.weight, b)
    if b is None:
        return torch.mm(x, lin.weight.t(), out=out)
    return torch.addmm(b, x, lin.weight.t(), out=out)


def normed_input(norm: RMSNorm, lin: nn.Module, x: torch.Tensor,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 q8: Fp8Scratch | None = None) -> torch.Tensor | QuantizedRows:
    """norm(x) as `lin` reads it. With `residual`: residual += x first, in place, and the
    normed rows overwrite x (as RMSNorm); else into `out`. A quantized `lin` gets e4m3 rows
    from the same launch instead (x is then left as it was)."""
    if isinstance(lin, nn.Linear):
        return norm(x, out=out) if residual is None else norm(x, residual)[0]
    return lin.quantize(x, q8, residual=residual, norm=norm)


def mlp_row_chunks(rows: int, cap: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of nearly equal size, at most `cap` rows, multiples of MLP_ROW_ALIGN."""
    assert rows > 0 and cap > 0, f"{rows} rows in chunks of at most {cap}"
    k = -(-rows // cap)
    if k == 1:
        return [(0, rows)]
    even = -(-rows // k)
    size = min(cap, -(-even // MLP_ROW_ALIGN) * MLP_ROW_ALIGN)
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def gated_mlp(x: torch.Tensor | QuantizedRows, gate_up: nn.Module, down: nn.Module,
              use_triton: bool, out: torch.Tensor | None = None,
              scratch: torch.Tensor | None = None, norm_eps: float | None = None,
              activation: str = "silu", q8: Fp8Scratch | None = None) -> torch.Tensor:
    """down(act(gate) * up), chunked to `scratch`'s rows; `norm_eps`: x += mlp(norm(x)).
    `q8`: where a quantized down projection's input goes (a chunk's rows)."""
    rows = x.shape[0]
    assert norm_eps is None or out is x, "a folded-norm MLP adds into the residual it reads"
    if scratch is None or scratch.shape[0] >= rows:
        return _gated_mlp(x, gate_up, down, use_triton, out,
                          None if scratch is None else scratch[:rows], norm_eps, activation, q8)
    if out is None:
        out = torch.empty(rows, down.out_features, dtype=scratch.dtype, device=scratch.device)
    # NOTE: x and out may be one buffer: each chunk reads its rows before writing them
    for lo, hi in mlp_row_chunks(rows, scratch.shape[0]):
        _gated_mlp(x[lo:hi], gate_up, down, use_triton, out[lo:hi], scratch[: hi - lo], norm_eps,
                   activation, q8)
    return out


def _gated_mlp(x: torch.Tensor | QuantizedRows, gate_up: nn.Module, down: nn.Module,
               use_triton: bool, out: torch.Tensor | None, scratch: torch.Tensor | None,
               norm_eps: float | None, activation: str,
               q8: Fp8Scratch | None) -> torch.Tensor:
    gu = linear(x, gate_up, scratch)  # (T, 2F)
    f = gu.shape[1] // 2
    folded = norm_eps is not None
    if not isinstance(down, nn.Linear):
        assert not folded, "quantized projections run with their norms unfolded"
        return linear(down.quantize_act(gu, activation, q8), down, out)
    # NOTE: in place into gu's gate half: each element is read by the program that writes it
    act = ops.act_and_mul(gu, out=gu[:, :f], use_triton=use_triton,  # (T, F), strided rows
                          activation=activation, norm_rows=x if folded else None,
                          eps=norm_eps or 0.0)
    return linear(act, down, out, accumulate=folded)  # (T, hidden)


class MLP(nn.Module):
    """The gated MLP: SwiGLU (Llama, Qwen) or GeGLU with GeLU-tanh (Gemma)."""

    def __init__(self, hidden: int, inter: int, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation = activation
        self.use_triton = False

    def forward(self, x: torch.Tensor | QuantizedRows, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, norm_eps: float | None = None,
                q8: Fp8Scratch | None = None) -> torch.Tensor:
        return gated_mlp(x, self.gate_up_proj, self.down_proj, self.use_triton, out, scratch,
                         norm_eps, self.activation, q8)
