"""RMSNorm and the gated MLP; `out`/`scratch`/`qin` buffers let a graph step allocate nothing,
and each projection's `normed`/`gated` write its input in the norm's or activation's launch."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from service.model.quant import Projection, Rows, Scratch
from service.model.quant.plain import Linear

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


def mlp_row_chunks(rows: int, cap: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of nearly equal size, at most `cap` rows, multiples of MLP_ROW_ALIGN."""
    assert rows > 0 and cap > 0, f"{rows} rows in chunks of at most {cap}"
    k = -(-rows // cap)
    if k == 1:
        return [(0, rows)]
    even = -(-rows // k)
    size = min(cap, -(-even // MLP_ROW_ALIGN) * MLP_ROW_ALIGN)
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def gated_mlp(x: Rows, gate_up: Projection, down: Projection, use_triton: bool,
              out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
              norm_eps: float | None = None, activation: str = "silu",
              qin: Scratch | None = None) -> torch.Tensor:
    """down(act(gate) * up) of x (or `normed` rows), chunked; `norm_eps`: x += mlp(norm(x))."""
    rows = x.shape[0]
    assert norm_eps is None or out is x, "a folded-norm MLP adds into the residual it reads"
    if scratch is None or scratch.shape[0] >= rows:
        return _gated_mlp(x, gate_up, down, use_triton, out,
                          None if scratch is None else scratch[:rows], norm_eps, activation, qin)
    if out is None:
        out = torch.empty(rows, down.out_features, dtype=scratch.dtype, device=scratch.device)
    # NOTE: x and out may be one buffer: each chunk reads its rows before writing them
    for lo, hi in mlp_row_chunks(rows, scratch.shape[0]):
        _gated_mlp(x[lo:hi], gate_up, down, use_triton, out[lo:hi], scratch[: hi - lo], norm_eps,
                   activation, qin)
    return out


def _gated_mlp(x: Rows, gate_up: Projection, down: Projection, use_triton: bool,
               out: torch.Tensor | None, scratch: torch.Tensor | None, norm_eps: float | None,
               activation: str, qin: Scratch | None) -> torch.Tensor:
    gu = gate_up.matmul(x, scratch)  # (T, 2F)
    folded = norm_eps is not None
    act = down.gated(gu, activation, qin, use_triton=use_triton,
                     norm_rows=x if folded else None, eps=norm_eps or 0.0)
    return down.matmul(act, out, accumulate=folded)  # (T, hidden)


class MLP(nn.Module):
    """The gated MLP: SwiGLU (Llama, Qwen) or GeGLU with GeLU-tanh (Gemma)."""

    def __init__(self, hidden: int, inter: int, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.activation = activation
        self.use_triton = False

    def forward(self, x: Rows, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, norm_eps: float | None = None,
                qin: Scratch | None = None) -> torch.Tensor:
        return gated_mlp(x, self.gate_up_proj, self.down_proj, self.use_triton, out, scratch,
                         norm_eps, self.activation, qin)
