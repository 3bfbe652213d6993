"""FP8 W8A8 schemes: QUANTIZATION=fp8 and `fp8` checkpoints of 128 × 128 blocks (fp8_linear.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kernels.quant_fp8 import E4M3
from service.model.errors import ModelLoadError
from service.model.quant import Scheme, replace_projections
from service.model.quant.fp8_linear import BLOCK, Fp8Linear, Fp8Scratch

_ACTIVATIONS = {"token": "per token", "tensor": "static per tensor",
                "group": f"per {BLOCK}-column group"}


@dataclass(frozen=True)
class Fp8(Scheme):
    weights: str = "channel"  # "channel" | "tensor" | "block"
    activations: str = "token"  # "token" (dynamic) | "tensor" (static input_scale) | "group"
    scale_name: str = "weight_scale"  # the weight scale's tensor suffix in a checkpoint
    ignore: tuple[str, ...] = ()  # modules kept in high precision: names or "re:" patterns
    name: ClassVar[str] = "fp8"

    @property
    def label(self) -> str:
        weights = f"{BLOCK}x{BLOCK} block" if self.weights == "block" else self.weights
        return f"fp8 e4m3, weights per {weights}, activations {_ACTIVATIONS[self.activations]}"

    def choose(self, qc: Mapping[str, Any], refuse: Callable[[str], Exception]) -> Fp8 | None:
        if qc.get("quant_method") != "fp8":
            return None
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme") != "dynamic":
            raise refuse(f"fp8 fmt {qc.get('fmt')!r}, activation_scheme "
                         f"{qc.get('activation_scheme')!r}")
        if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
            raise refuse(f"fp8 weight_block_size {qc.get('weight_block_size')!r}")
        return Fp8("block", "group", "weight_scale_inv",
                   tuple(qc.get("modules_to_not_convert") or ()))

    def convert(self, model: nn.Module) -> None:
        quantize_model(model)

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module
                   for p in self.ignore)

    def load(self, tensors: Mapping[str, torch.Tensor], parts: list[str],
             shapes: list[tuple[int, int]], bias: torch.Tensor | None, where: str) -> Fp8Linear:
        """Weights and scales stacked exactly (per-tensor scales become the rows' scales)."""
        weights, scales, inputs = [], [], []
        for name, (rows, cols) in zip(parts, shapes):
            w, s = tensors.get(f"{name}.weight"), tensors.get(f"{name}.{self.scale_name}")
            if w is None or s is None:
                raise ModelLoadError(f"{where}: {name}: FP8 weight or {self.scale_name} missing")
            if w.dtype != E4M3 or tuple(w.shape) != (rows, cols):
                raise ModelLoadError(f"{where}: {name}.weight is {w.dtype} {tuple(w.shape)}, "
                                     f"expected float8_e4m3fn {(rows, cols)}")
            weights.append(w)
            scales.append(self._scale(s.float(), rows, cols, f"{where}: {name}"))
            if self.activations == "tensor":
                x = tensors.get(f"{name}.input_scale")
                if x is None:
                    raise ModelLoadError(f"{where}: {name}.input_scale missing (static "
                                         "activations)")
                inputs.append(x.float().reshape(()))
        # one input, one scale: projections that read the same rows were calibrated alike
        if any(not torch.equal(inputs[0], x) for x in inputs[1:]):
            raise ModelLoadError(f"{where}: {', '.join(parts)} read the same input with different "
                                 "input_scale values; a fused projection needs one")
        return Fp8Linear(torch.cat(weights), torch.cat(scales), bias,
                         inputs[0] if inputs else None)

    def _scale(self, s: torch.Tensor, rows: int, cols: int, where: str) -> torch.Tensor:
        if self.weights == "block":
            if s.shape != (rows // BLOCK, cols // BLOCK) or rows % BLOCK or cols % BLOCK:
                raise ModelLoadError(f"{where}.{self.scale_name} {tuple(s.shape)} for a "
                                     f"{(rows, cols)} weight in {BLOCK}-blocks")
            return s
        if s.numel() == 1 and self.weights == "tensor":
            return s.reshape(()).expand(rows).clone()
        if s.numel() == rows and self.weights == "channel":
            return s.reshape(rows)
        raise ModelLoadError(f"{where}.{self.scale_name} has shape {tuple(s.shape)} for "
                             f"per-{self.weights} scales")

    def scratch(self, rows: int, cols: int, device: torch.device | str) -> Fp8Scratch:
        return Fp8Scratch.allocate(rows, cols, device)


SCHEME = Fp8()


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Per-channel FP8 in place; pre-norms fold in first, so weight (not token) scales take them."""
    assert not getattr(model, "norms_folded", False), "quantize before folding norms"
    for layer in model.layers:
        if (not layer.cfg.sandwich_norms and layer.qkv_proj.foldable
                and layer.mlp.gate_up_proj.foldable):
            layer.fold_norm_weights()
    replace_projections(model, lambda p: Fp8Linear.from_linear(p) if p.foldable else None)
    model.scheme = SCHEME
