"""Copy a checkpoint's tensors, named as its family says, into the decoder's fused modules."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from service.model.decoder import DecoderModel
from service.model.errors import ModelLoadError
from service.model.families import Family, family
from service.model.quant import Scheme


def _take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
          where: str) -> torch.Tensor:
    if name not in tensors:
        raise ModelLoadError(f"{where}: missing tensor {name!r}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ModelLoadError(
            f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
    return t


def decoder_prefix(fam: Family, tensors: Mapping[str, torch.Tensor], where: str) -> str:
    """The family's prefix the checkpoint uses; "" when saved from the bare decoder (XModel)."""
    for p in (*fam.prefixes, ""):
        if p + "embed_tokens.weight" in tensors:
            return p
    raise ModelLoadError(f"{where}: missing tensor {fam.prefixes[0] + 'embed_tokens.weight'!r}")


@torch.no_grad()
def load_hf_state(model: DecoderModel, tensors: Mapping[str, torch.Tensor], where: str,
                  scheme: Scheme | None = None) -> None:
    """With a checkpoint's `scheme`, the projections it covers load as the checkpoint has them."""
    c = model.cfg
    fam = family(c.arch)
    h, f, qs, kvs, d = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size, c.head_dim
    pre = decoder_prefix(fam, tensors, where)

    def put(param: torch.Tensor, *parts: torch.Tensor) -> None:
        src = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        if src.element_size() == 1:  # an 8-bit tensor needs its scales: never cast alone
            raise ModelLoadError(f"{where}: a {src.dtype} tensor outside a quantization scheme "
                                 "(config.json has no quantization_config covering it)")
        param.copy_(src.to(param.dtype))

    def projection(owner: torch.nn.Module, attr: str, parts: list[str],
                   shapes: list[tuple[int, int]], bias: list[str] | None = None) -> None:
        """owner.attr from the stacked checkpoint modules `parts` (the scheme's where it says)."""
        b = None if bias is None else [_take(tensors, f"{n}.bias", (r,), where)
                                        for n, (r, _) in zip(bias, shapes)]
        if scheme is not None and not any(scheme.ignores(n) for n in parts):
            lin = scheme.load(tensors, parts, shapes, None if b is None else torch.cat(b), where)
            setattr(owner, attr, lin.to(getattr(owner, attr).weight.device))
            return
        lin = getattr(owner, attr)
        put(lin.weight, *(_take(tensors, f"{n}.weight", shape, where)
                          for n, shape in zip(parts, shapes)))
        if b is not None:
            put(lin.bias, *b)

    def put_norm(param: torch.Tensor, name: str, size: int) -> None:
        w = _take(tensors, name, (size,), where)
        put(param, w.float() + fam.norm_offset if fam.norm_offset else w)

    put(model.embed_tokens.weight, _take(tensors, pre + "embed_tokens.weight", (c.vocab_size, h),
                                         where))
    for i, layer in enumerate(model.layers):
        p = f"{pre}layers.{i}."
        for ours, theirs in fam.norms.items():
            put_norm(getattr(layer, ours).weight, f"{p}{theirs}.weight", h)
        n = {slot: p + theirs for slot, theirs in fam.projections.items()}
        qkv = [n["q"], n["k"], n["v"]]
        projection(layer, "qkv_proj", qkv, [(qs, h), (kvs, h), (kvs, h)],
                   qkv if c.qkv_bias else None)
        for ours, theirs in fam.qk_norms.items() if c.qk_norm else ():
            put_norm(getattr(layer, ours).weight, f"{p}{theirs}.weight", d)
        projection(layer, "o_proj", [n["o"]], [(h, qs)])
        projection(layer.mlp, "gate_up_proj", [n["gate"], n["up"]], [(f, h), (f, h)])
        projection(layer.mlp, "down_proj", [n["down"]], [(h, f)])
    put_norm(model.norm.weight, pre + "norm.weight", h)
    if model.lm_head is not None:
        put(model.lm_head.weight, _take(tensors, "lm_head.weight", (c.vocab_size, h), where))
    if scheme is not None:
        model.scheme = scheme
