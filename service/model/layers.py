"""The decoder's building blocks: RMSNorm, projections into given buffers, and the SwiGLU MLP.

Every block takes optional `out`/`scratch` buffers: the graph runners pass slices of their static
buffers so that a captured step allocates nothing; eager calls allocate. Both run the same
kernels, so a graph replay and an eager forward agree on the same rows (up to the MLP's row
chunks, whose smaller matmuls the BLAS may tile differently).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops

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


def linear(x: torch.Tensor, lin: nn.Linear, out: torch.Tensor | None = None, *,
           accumulate: bool = False, bias: bool = True) -> torch.Tensor:
    """`lin(x)`, optionally into `out`: the same mm/addmm F.linear runs, without an allocation.
    `accumulate`: out += x @ W^T in the GEMM (no bias); `bias=False` leaves the bias out."""
    if accumulate:
        assert out is not None and lin.bias is None, "accumulate into an out, without a bias"
        return out.addmm_(x, lin.weight.t())
    b = lin.bias if bias else None
    if out is None:
        return torch.nn.functional.linear(x, lin.weight, b)
    if b is None:
        return torch.mm(x, lin.weight.t(), out=out)
    return torch.addmm(b, x, lin.weight.t(), out=out)


def mlp_row_chunks(rows: int, cap: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of at most `cap` rows: k = ceil(rows / cap) chunks of ceil(rows / k)
    rows rounded up to MLP_ROW_ALIGN (but at most `cap`), the last one taking the rest."""
    assert rows > 0 and cap > 0, f"{rows} rows in chunks of at most {cap}"
    k = -(-rows // cap)
    if k == 1:
        return [(0, rows)]
    even = -(-rows // k)
    size = min(cap, -(-even // MLP_ROW_ALIGN) * MLP_ROW_ALIGN)
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def swiglu(x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, use_triton: bool,
           out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
           norm_eps: float | None = None) -> torch.Tensor:
    """down(silu(gate) * up); `scratch` (<= T, 2F) holds gate|up, then the activation in place.

    `norm_eps` (folded norms): x is the residual stream and gate_up's weight has the norm
    weight folded in; the activation scales by each row's rstd, and down adds into `out`,
    which must be x itself (x <- x + mlp(norm(x))).

    With fewer scratch rows than x has, runs in row chunks of nearly equal size (multiples of
    MLP_ROW_ALIGN) that fit in it: the graph runner's arena is sized for attention, not for
    2F-wide rows. Chunk shapes depend on the row count only, so a captured bucket replays the
    same loop.
    """
    rows = x.shape[0]
    assert norm_eps is None or out is x, "a folded-norm MLP adds into the residual it reads"
    if scratch is None or scratch.shape[0] >= rows:
        return _swiglu(x, gate_up, down, use_triton, out,
                       None if scratch is None else scratch[:rows], norm_eps)
    if out is None:
        out = x.new_empty(rows, down.out_features)
    # NOTE: x and out may be one buffer. Chunk [lo, hi) reads x[lo:hi] (all of it, in the
    # gate_up matmul) before writing out[lo:hi], and no chunk touches another's rows.
    for lo, hi in mlp_row_chunks(rows, scratch.shape[0]):
        _swiglu(x[lo:hi], gate_up, down, use_triton, out[lo:hi], scratch[: hi - lo], norm_eps)
    return out


def _swiglu(x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, use_triton: bool,
            out: torch.Tensor | None, scratch: torch.Tensor | None,
            norm_eps: float | None = None) -> torch.Tensor:
    gu = linear(x, gate_up, scratch)  # (T, 2F)
    f = gu.shape[1] // 2
    folded = norm_eps is not None
    # NOTE: in place into gu's gate half (row stride 2F): each element is read by the one
    # program that writes it, so this is safe and saves a (T, F) tensor.
    act = ops.silu_and_mul(gu, out=gu[:, :f], use_triton=use_triton,  # (T, F), strided rows
                           norm_rows=x if folded else None, eps=norm_eps or 0.0)
    return linear(act, down, out, accumulate=folded)  # (T, hidden)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.use_triton = False

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None,
                norm_eps: float | None = None) -> torch.Tensor:
        return swiglu(x, self.gate_up_proj, self.down_proj, self.use_triton, out, scratch,
                      norm_eps)
