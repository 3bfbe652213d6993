"""Copy a checkpoint's state dict (Hugging Face names) into the decoder's fused modules, by the
family's name mapping, checking every shape."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from service.model.decoder import DecoderModel
from service.model.errors import ModelLoadError
from service.model.families import Family, family


def _take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
          where: str) -> torch.Tensor:
    if name not in tensors:
        raise ModelLoadError(f"{where}: missing tensor {name!r}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ModelLoadError(
            f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
    return t


def _prefix(fam: Family, tensors: Mapping[str, torch.Tensor], where: str) -> str:
    for p in fam.prefixes:
        if p + "embed_tokens.weight" in tensors:
            return p
    raise ModelLoadError(f"{where}: missing tensor {fam.prefixes[0] + 'embed_tokens.weight'!r}")


@torch.no_grad()
def load_hf_state(model: DecoderModel, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """`tensors` use the checkpoint's names (model.layers.N.self_attn.q_proj.weight, ...)."""
    c = model.cfg
    fam = family(c.arch)
    h, f, qs, kvs, d = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size, c.head_dim
    pre = _prefix(fam, tensors, where)

    def put(param: torch.Tensor, *parts: torch.Tensor) -> None:
        src = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        param.copy_(src.to(param.dtype))

    def put_norm(param: torch.Tensor, name: str, size: int) -> None:
        w = _take(tensors, name, (size,), where)
        put(param, w.float() + fam.norm_offset if fam.norm_offset else w)

    put(model.embed_tokens.weight, _take(tensors, pre + "embed_tokens.weight", (c.vocab_size, h),
                                         where))
    for i, layer in enumerate(model.layers):
        p = f"{pre}layers.{i}."
        for ours, theirs in fam.norms.items():
            put_norm(getattr(layer, ours).weight, f"{p}{theirs}.weight", h)
        a = p + "self_attn."
        put(layer.qkv_proj.weight, _take(tensors, a + "q_proj.weight", (qs, h), where),
            _take(tensors, a + "k_proj.weight", (kvs, h), where),
            _take(tensors, a + "v_proj.weight", (kvs, h), where))
        if c.qkv_bias:
            put(layer.qkv_proj.bias, _take(tensors, a + "q_proj.bias", (qs,), where),
                _take(tensors, a + "k_proj.bias", (kvs,), where),
                _take(tensors, a + "v_proj.bias", (kvs,), where))
        if c.qk_norm:
            put_norm(layer.q_norm.weight, a + "q_norm.weight", d)
            put_norm(layer.k_norm.weight, a + "k_norm.weight", d)
        put(layer.o_proj.weight, _take(tensors, a + "o_proj.weight", (h, qs), where))
        m = p + "mlp."
        put(layer.mlp.gate_up_proj.weight, _take(tensors, m + "gate_proj.weight", (f, h), where),
            _take(tensors, m + "up_proj.weight", (f, h), where))
        put(layer.mlp.down_proj.weight, _take(tensors, m + "down_proj.weight", (h, f), where))
    put_norm(model.norm.weight, pre + "norm.weight", h)
    if model.lm_head is not None:
        put(model.lm_head.weight, _take(tensors, "lm_head.weight", (c.vocab_size, h), where))
