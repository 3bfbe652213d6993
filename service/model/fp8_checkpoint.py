"""FP8 checkpoints as published: read `quantization_config`, refuse what cannot run exactly, and
build each fused projection's `Fp8Linear` from the checkpoint's tensors.

Served: compressed-tensors `float-quantized` (8-bit float weights per channel or per tensor;
activations dynamic per token or static per tensor) and the `fp8` method with
`weight_block_size: [128, 128]` (dynamic activations per 128-column group)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from service.model.errors import ModelLoadError
from service.model.fp8 import BLOCK, E4M3, Fp8Linear


@dataclass(frozen=True)
class Fp8Scheme:
    weights: str  # "channel" | "tensor" | "block"
    activations: str  # "token" (dynamic) | "tensor" (static input_scale) | "group" (dynamic)
    scale_name: str  # the weight scale's tensor suffix
    ignore: tuple[str, ...] = ()  # modules kept in high precision: names or "re:" patterns

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module
                   for p in self.ignore)


def scheme_of(raw: dict[str, Any], where: str) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json, None without `quantization_config`; ModelLoadError for
    one the loader cannot run exactly, naming what it found."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None:
        return None

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quantization_config {what} is not supported (served: "
                              "compressed-tensors float-quantized FP8, per channel or tensor; "
                              "fp8 with weight_block_size [128, 128])")

    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme") != "dynamic":
            raise refuse(f"fp8 fmt {qc.get('fmt')!r}, activation_scheme "
                         f"{qc.get('activation_scheme')!r}")
        if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
            raise refuse(f"fp8 weight_block_size {qc.get('weight_block_size')!r}")
        return Fp8Scheme("block", "group", "weight_scale_inv",
                         tuple(qc.get("modules_to_not_convert") or ()))
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r}")
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("format") != "float-quantized" or len(groups) != 1:
        raise refuse(f"format {qc.get('format')!r} with {len(groups)} config groups")
    g = groups[0]
    w, a = g.get("weights") or {}, g.get("input_activations")
    if not (w.get("num_bits") == 8 and w.get("type") == "float" and w.get("symmetric", True)
            and not w.get("dynamic") and w.get("strategy") in ("channel", "tensor")):
        raise refuse(f"weights {w}")
    if a is None:
        raise refuse("without input_activations (weight-only FP8)")
    dynamic_token = a.get("strategy") == "token" and a.get("dynamic")
    static_tensor = a.get("strategy") == "tensor" and not a.get("dynamic")
    if not (a.get("num_bits") == 8 and a.get("type") == "float" and a.get("symmetric", True)
            and (dynamic_token or static_tensor)):
        raise refuse(f"input_activations {a}")
    if set(g.get("targets") or ["Linear"]) != {"Linear"}:
        raise refuse(f"targets {g.get('targets')}")
    return Fp8Scheme(w["strategy"], "token" if dynamic_token else "tensor", "weight_scale",
                     tuple(qc.get("ignore") or ()))


def fused_fp8(tensors: Mapping[str, torch.Tensor], scheme: Fp8Scheme, parts: list[str],
              shapes: list[tuple[int, int]], bias: torch.Tensor | None,
              where: str) -> Fp8Linear:
    """One Fp8Linear of the row-stacked projections `parts` (module names, e.g. ...q_proj), each
    of (rows, cols) `shapes`: weights and scales stacked exactly (per-tensor scales become the
    rows' per-channel scales)."""
    weights, scales, inputs = [], [], []
    for name, (rows, cols) in zip(parts, shapes):
        w = tensors.get(f"{name}.weight")
        s = tensors.get(f"{name}.{scheme.scale_name}")
        if w is None or s is None:
            raise ModelLoadError(f"{where}: {name}: FP8 weight or {scheme.scale_name} missing")
        if w.dtype != E4M3 or tuple(w.shape) != (rows, cols):
            raise ModelLoadError(f"{where}: {name}.weight is {w.dtype} {tuple(w.shape)}, "
                                 f"expected float8_e4m3fn {(rows, cols)}")
        s = s.float()
        if scheme.weights == "block":
            if s.shape != (rows // BLOCK, cols // BLOCK) or rows % BLOCK or cols % BLOCK:
                raise ModelLoadError(f"{where}: {name}.{scheme.scale_name} {tuple(s.shape)} "
                                     f"for a {(rows, cols)} weight in {BLOCK}-blocks")
        elif s.numel() == 1 and scheme.weights == "tensor":
            s = s.reshape(()).expand(rows).clone()
        elif s.numel() == rows and scheme.weights == "channel":
            s = s.reshape(rows)
        else:
            raise ModelLoadError(f"{where}: {name}.{scheme.scale_name} has shape "
                                 f"{tuple(s.shape)} for per-{scheme.weights} scales")
        weights.append(w)
        scales.append(s)
        if scheme.activations == "tensor":
            x = tensors.get(f"{name}.input_scale")
            if x is None:
                raise ModelLoadError(f"{where}: {name}.input_scale missing (static activations)")
            inputs.append(x.float().reshape(()))
    input_scale = None
    if inputs:
        # one input, one scale: projections that read the same rows were calibrated alike
        if any(not torch.equal(inputs[0], x) for x in inputs[1:]):
            raise ModelLoadError(f"{where}: {', '.join(parts)} read the same input with different "
                                 "input_scale values; a fused projection needs one")
        input_scale = inputs[0]
    return Fp8Linear(torch.cat(weights), torch.cat(scales), bias, input_scale)
