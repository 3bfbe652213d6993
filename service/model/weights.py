"""Copy a Hugging Face-named state dict into our fused modules, checking every shape."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from service.model.errors import ModelLoadError
from service.model.llama import LlamaModel


def _take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
          where: str) -> torch.Tensor:
    if name not in tensors:
        raise ModelLoadError(f"{where}: missing tensor {name!r}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ModelLoadError(
            f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
    return t


@torch.no_grad()
def load_hf_state(model: LlamaModel, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """`tensors` use HF names (model.layers.N.self_attn.q_proj.weight, ...)."""
    c = model.cfg
    h, f, qs, kvs = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size

    def put(param: torch.Tensor, *parts: torch.Tensor) -> None:
        src = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        param.copy_(src.to(param.dtype))

    put(model.embed_tokens.weight, _take(tensors, "model.embed_tokens.weight", (c.vocab_size, h),
                                         where))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_layernorm.weight, _take(tensors, p + "input_layernorm.weight", (h,), where))
        put(layer.post_attention_layernorm.weight,
            _take(tensors, p + "post_attention_layernorm.weight", (h,), where))
        a = p + "self_attn."
        put(layer.qkv_proj.weight, _take(tensors, a + "q_proj.weight", (qs, h), where),
            _take(tensors, a + "k_proj.weight", (kvs, h), where),
            _take(tensors, a + "v_proj.weight", (kvs, h), where))
        if c.qkv_bias:
            put(layer.qkv_proj.bias, _take(tensors, a + "q_proj.bias", (qs,), where),
                _take(tensors, a + "k_proj.bias", (kvs,), where),
                _take(tensors, a + "v_proj.bias", (kvs,), where))
        put(layer.o_proj.weight, _take(tensors, a + "o_proj.weight", (h, qs), where))
        m = p + "mlp."
        put(layer.mlp.gate_up_proj.weight, _take(tensors, m + "gate_proj.weight", (f, h), where),
            _take(tensors, m + "up_proj.weight", (f, h), where))
        put(layer.mlp.down_proj.weight, _take(tensors, m + "down_proj.weight", (h, f), where))
    put(model.norm.weight, _take(tensors, "model.norm.weight", (h,), where))
    if model.lm_head is not None:
        put(model.lm_head.weight, _take(tensors, "lm_head.weight", (c.vocab_size, h), where))
