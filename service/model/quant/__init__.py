"""Quantization schemes: a module each (`SCHEME`), a line in `_ENTRIES`; torch-free for config."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

from service.model.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")
Rows = Any  # a projection's input: a (T, K) tensor, or what its `normed` or `gated` returned


class Projection(Protocol):
    """y = x @ W^T (+ bias), as every projection of the decoder runs it (plain: plain.Linear)."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    foldable: bool  # a norm's weight may be multiplied into W (DecoderModel.fold_norms)

    def matmul(self, x: Rows, out: torch.Tensor | None = None, *, accumulate: bool = False,
               bias: bool = True, scratch: Any = None) -> torch.Tensor:
        """x @ W^T (+ bias) into `out` (`accumulate`: +=); `scratch`: where x goes re-encoded."""

    def normed(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, scratch: Any = None) -> Rows:
        """norm(x) as this projection reads it; with `residual`: residual += x first."""

    def gated(self, gate_up: torch.Tensor, activation: str, scratch: Any = None, *,
              use_triton: bool = False, norm_rows: torch.Tensor | None = None,
              eps: float = 0.0) -> Rows:
        """act(gate) * up of a (T, 2F) gate|up output as this projection reads it."""

    def fold_norm(self, weight: torch.Tensor) -> None:
        """W <- W * weight (per input column): the norm before it runs with unit weights."""


class Scratch(Protocol):
    nbytes: int


class Scheme:
    """The plain scheme (projections in the model's dtype); other schemes override."""

    name = "none"
    label = "none"  # what /info and prefill_model_info report

    def choose(self, qc: Mapping[str, Any], refuse: Callable[[str], Exception]
               ) -> Scheme | None:
        """The scheme for checkpoint config `qc`, None if not ours; refuse(what) if not exact."""
        return None

    def convert(self, model: nn.Module) -> None:
        """QUANTIZATION=<name>: the loaded model's plain projections to this scheme."""

    def ignores(self, module: str) -> bool:
        return True

    def load(self, tensors: Mapping[str, torch.Tensor], parts: list[str],
             shapes: list[tuple[int, int]], bias: torch.Tensor | None, where: str) -> Projection:
        """One projection of the row-stacked checkpoint modules `parts` of (rows, cols) `shapes`."""
        raise NotImplementedError(self.name)

    def scratch(self, rows: int, cols: int, device: torch.device | str) -> Scratch | None:
        """Where inputs of up to `rows` x `cols` go in the graph runners' static buffers."""
        return None


@dataclass(frozen=True)
class Entry:
    module: str | Scheme  # a module of this package that defines SCHEME, or the scheme itself
    setting: str | None = None  # what QUANTIZATION=<name> does; None: checkpoints choose it
    loads: str | None = None  # the quantization_config it loads, as the README names it


_ENTRIES: dict[str, Entry] = {
    "none": Entry("plain", setting="the projections as the checkpoint holds them"),
    "fp8": Entry("fp8", setting=(
        "every layer's projections in FP8 e4m3 (per-output-channel weight scales, per-token "
        "dynamic activation scales, fp32 sums), quantized at start-up with the pre-norms' "
        "weights multiplied in (the norms' launches write the quantized rows); embedding and "
        "LM head stay. Halves the projections' memory; the KV pool takes what is freed. GPU: "
        "Triton quantization kernels, cuBLASLt row-wise and Triton block-scaled GEMMs, in the "
        "CUDA graphs; CPU: the exact PyTorch reference"),
        loads="fp8 with 128 × 128 blocks"),
    "compressed-tensors": Entry("compressed_tensors", loads=(
        "compressed-tensors float-quantized FP8 per channel, tensor or 128 × 128 block")),
}
_LOADED: dict[str, Scheme] = {}


def register(scheme: Scheme, setting: str | None = None, loads: str | None = None) -> None:
    _ENTRIES[scheme.name] = Entry(scheme, setting, loads)
    _LOADED.pop(scheme.name, None)


def unregister(name: str) -> None:
    _ENTRIES.pop(name, None)
    _LOADED.pop(name, None)


def settings() -> tuple[str, ...]:
    """The values QUANTIZATION takes."""
    return tuple(n for n, e in _ENTRIES.items() if e.setting)


def setting_help() -> str:
    values = "; ".join(f"`{n}`: {e.setting}" for n, e in _ENTRIES.items() if e.setting)
    return f"{values}. Quantized checkpoints ({_loads()}) load as published whatever this says."


def _loads() -> str:
    return "; ".join(e.loads for e in _ENTRIES.values() if e.loads)


def scheme(name: str) -> Scheme:
    if name not in _LOADED:
        assert name in _ENTRIES, f"quantization scheme {name!r}: one of {', '.join(_ENTRIES)}"
        m = _ENTRIES[name].module
        _LOADED[name] = import_module(f"{__name__}.{m}").SCHEME if isinstance(m, str) else m
    return _LOADED[name]


def of_checkpoint(raw: Mapping[str, Any], where: str) -> Scheme | None:
    """A config.json's scheme (None: unquantized); ModelLoadError naming what no scheme runs."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None:
        return None

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quantization_config {what} is not supported (served: "
                              f"{_loads()})")

    for name in _ENTRIES:
        chosen = scheme(name).choose(qc, refuse)
        if chosen is not None:
            return chosen
    raise refuse(f"quant_method {qc.get('quant_method')!r}")


def apply(model: nn.Module, name: str) -> None:
    """QUANTIZATION=`name` on a loaded model; a quantized checkpoint keeps its own scheme."""
    assert name in settings(), f"QUANTIZATION={name!r}: one of {', '.join(settings())}"
    if model.scheme.name == "none":
        scheme(name).convert(model)
    elif name != "none":
        log.warning("QUANTIZATION=%s ignored: the checkpoint is quantized (%s) and loads as "
                    "published", name, model.scheme.label)


def replace_projections(model: nn.Module, fn: Callable[[Projection], Projection | None]) -> None:
    for layer in model.layers:
        for path in PROJECTIONS:
            owner, _, attr = path.rpartition(".")
            parent = layer.get_submodule(owner) if owner else layer
            new = fn(getattr(parent, attr))
            if new is not None:
                setattr(parent, attr, new)
