"""The plain scheme: projections in the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from service.model.quant import Scheme


class Linear(nn.Linear):
    """nn.Linear with the Projection interface (service/model/quant/__init__.py)."""

    foldable = True

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
               accumulate: bool = False, bias: bool = True, scratch: None = None
               ) -> torch.Tensor:
        if accumulate:
            assert out is not None and self.bias is None, "accumulate into an out, without a bias"
            return out.addmm_(x, self.weight.t())
        b = self.bias if bias else None
        if out is None:
            return torch.nn.functional.linear(x, self.weight, b)
        if b is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(b, x, self.weight.t(), out=out)

    def normed(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, scratch: None = None) -> torch.Tensor:
        """With `residual` the normed rows overwrite x (as RMSNorm does); else into `out`."""
        return norm(x, out=out) if residual is None else norm(x, residual)[0]

    def gated(self, gate_up: torch.Tensor, activation: str, scratch: None = None, *,
              use_triton: bool = False, norm_rows: torch.Tensor | None = None,
              eps: float = 0.0) -> torch.Tensor:
        """Into gate_up's gate half in place (each element is read by the program writing it)."""
        f = gate_up.shape[1] // 2
        return ops.act_and_mul(gate_up, out=gate_up[:, :f], use_triton=use_triton,
                               activation=activation, norm_rows=norm_rows, eps=eps)

    def fold_norm(self, weight: torch.Tensor) -> None:
        w = self.weight.data
        w.copy_(w.float().mul_(weight.float()[None, :]).to(w.dtype))


SCHEME = Scheme()
