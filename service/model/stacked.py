"""Every decoder layer's weights in one stack per kind, and a layer whose number is on the device.

The breakable runner captures the dense work between two attention breaks (post of layer c +
pre of layer c + 1) as one CUDA graph. With plain per-layer weights that graph can only ever
serve layer c, so a model of L layers holds L + 1 graphs per bucket, each ~130 KB of driver
memory (bench/graph_memory.py). `stack_layers` moves each kind of weight into one (L, ...)
tensor, re-pointing the layers' parameters at its rows (no copy is kept, eager forwards are
unchanged), and `IndexedLayer` reads row `layer[0] + offset` of each stack through the
layer-indexed kernels: one captured segment then serves every middle layer, replayed with the
device counter advanced by one each time.

`IndexedLayer` reuses DecoderLayer's `pre`/`qkv_rope`/`post` code unchanged: it only swaps the
modules they call for indexed stand-ins with the same call signatures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops
from service.model.llama import MLP, DecoderLayer, LlamaModel


@dataclass(frozen=True)
class LayerStack:
    """(L, ...) stacks of the decoder layers' weights; row i is layer i's parameter storage."""

    qkv: torch.Tensor  # (L, q + 2kv, hidden)
    qkv_bias: torch.Tensor | None  # (L, q + 2kv) (Qwen2) or None
    o: torch.Tensor  # (L, hidden, q)
    gate_up: torch.Tensor  # (L, 2F, hidden)
    down: torch.Tensor  # (L, hidden, F)
    input_norm: torch.Tensor  # (L, hidden)
    post_norm: torch.Tensor  # (L, hidden)


def _stack(params: list[nn.Parameter]) -> torch.Tensor:
    """One contiguous stack of `params`, each re-pointed at its row (each old storage is freed
    as it is moved: the peak is one extra copy of one kind of weight, not a second model)."""
    stack = torch.empty((len(params), *params[0].shape), dtype=params[0].dtype,
                        device=params[0].device)
    for i, p in enumerate(params):
        stack[i].copy_(p.data)
        p.data = stack[i]
    return stack


def stack_layers(model: LlamaModel) -> LayerStack:
    """Stack the layers' weights in place (idempotent: a stacked model returns its stack)."""
    cached = getattr(model, "_layer_stack", None)
    if cached is not None:
        return cached
    layers = list(model.layers)
    bias = None
    if layers[0].qkv_proj.bias is not None:
        bias = _stack([lay.qkv_proj.bias for lay in layers])
    st = LayerStack(
        qkv=_stack([lay.qkv_proj.weight for lay in layers]), qkv_bias=bias,
        o=_stack([lay.o_proj.weight for lay in layers]),
        gate_up=_stack([lay.mlp.gate_up_proj.weight for lay in layers]),
        down=_stack([lay.mlp.down_proj.weight for lay in layers]),
        input_norm=_stack([lay.input_layernorm.weight for lay in layers]),
        post_norm=_stack([lay.post_attention_layernorm.weight for lay in layers]))
    model._layer_stack = st
    return st


class IndexedLinear:
    """Stand-in for nn.Linear: row layer[0] + offset of a (L, N, K) stack."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, layer: torch.Tensor,
                 offset: int, use_triton: bool):
        self.w, self.bias, self.layer, self.offset, self.use_triton = w, bias, layer, offset, \
            use_triton
        self.out_features = w.shape[1]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
                 accumulate: bool = False, bias: bool = True) -> torch.Tensor:
        """Like service.model.llama.linear: `accumulate` adds into out, bias=False drops it."""
        return ops.indexed_linear(x, self.w, self.bias if bias else None, self.layer,
                                  self.offset, out, use_triton=self.use_triton,
                                  accumulate=accumulate)


class IndexedRMSNorm:
    """Stand-in for RMSNorm: row layer[0] + offset of an (L, hidden) stack."""

    def __init__(self, w: torch.Tensor, eps: float, layer: torch.Tensor, offset: int,
                 use_triton: bool):
        self.w, self.eps, self.layer, self.offset, self.use_triton = w, eps, layer, offset, \
            use_triton

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.w, self.eps, out=out, use_triton=self.use_triton,
                                layer=self.layer, offset=self.offset)
        return ops.fused_add_rms_norm(x, residual, self.w, self.eps, use_triton=self.use_triton,
                                      layer=self.layer, offset=self.offset)


class IndexedMLP:
    """Stand-in for MLP over indexed projections (MLP.forward's code)."""

    __call__ = MLP.forward

    def __init__(self, gate_up: IndexedLinear, down: IndexedLinear, use_triton: bool):
        self.gate_up_proj, self.down_proj, self.use_triton = gate_up, down, use_triton


class IndexedLayer:
    """Decoder layer number `layer[0] + offset`, `layer` an int32 (1,) tensor on the device.
    Same `pre`/`qkv_rope`/`post` as DecoderLayer, over the stacks."""

    pre = DecoderLayer.pre
    qkv_rope = DecoderLayer.qkv_rope
    post = DecoderLayer.post
    fuses_norm = DecoderLayer.fuses_norm

    def __init__(self, model: LlamaModel, stack: LayerStack, layer: torch.Tensor, offset: int):
        cfg = model.cfg
        tri = model.layers[0].use_triton
        self.cfg, self.use_triton = cfg, tri
        self.folded = model.norms_folded  # fold before building: the stack holds the weights
        self.input_layernorm = IndexedRMSNorm(stack.input_norm, cfg.rms_norm_eps, layer, offset,
                                              tri)
        self.post_attention_layernorm = IndexedRMSNorm(stack.post_norm, cfg.rms_norm_eps, layer,
                                                       offset, tri)
        self.qkv_proj = IndexedLinear(stack.qkv, stack.qkv_bias, layer, offset, tri)
        self.o_proj = IndexedLinear(stack.o, None, layer, offset, tri)
        self.mlp = IndexedMLP(IndexedLinear(stack.gate_up, None, layer, offset, tri),
                              IndexedLinear(stack.down, None, layer, offset, tri), tri)
