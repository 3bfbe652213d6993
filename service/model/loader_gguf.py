"""A GGUF of a family that names its llama.cpp architecture, dequantized, Q/K rows unpermuted."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from service.model.config import ModelConfig
from service.model.errors import ModelLoadError
from service.model.families import Family, family, family_for_gguf

# GGUF blk.N.<name> -> the decoder's slot, which the family names
_SLOTS = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "q", "attn_k": "k",
          "attn_v": "v", "attn_output": "o", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
          "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}


def _layer_names(fam: Family) -> dict[str, str]:
    theirs = {**fam.norms, **fam.qk_norms, **fam.projections}
    return {f"{g}.weight": f"{theirs[s]}.weight" for g, s in _SLOTS.items() if s in theirs}


ROPE_FREQS = "rope_freqs.weight"  # in gguf_tensors' output: per-pair RoPE frequency divisors


def rope_freq_scaling(factors: torch.Tensor) -> dict[str, Any]:
    """The rope_scaling of llama.cpp's rope_freqs: each pair's frequency divided by its factor."""
    return {"rope_type": "freq_factors", "factors": [float(f) for f in factors.flatten()]}


def config_from_gguf(meta: dict[str, Any], where: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    fam = family_for_gguf(arch, where)

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{where}: missing GGUF metadata key {full!r}")
        return meta[full]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not n_vocab:
        raise ModelLoadError(f"{where}: cannot tell the vocabulary size")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{where}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is "
                             "not supported in a GGUF")
    head_dim = meta.get(f"{arch}.attention.key_length",
                        meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    return ModelConfig(
        arch=fam.name,
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 8192)),
        tie_word_embeddings=False,  # decided by whether output.weight exists
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=str(meta.get("general.name", "gguf-model")),
        **fam.traits,
    )


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permutation (HF rotate-half rows -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(reader, cfg: ModelConfig, where: str) -> tuple[dict[str, torch.Tensor], bool]:
    """HF-named fp32 tensors from the GGUF, and whether the LM head is tied."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fam = family(cfg.arch)
    names, pre, permuted = _layer_names(fam), fam.prefixes[0], fam.gguf_permuted_qk
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.asarray(t.data, dtype=np.float32).reshape(shape)
            else:
                arr = dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise ModelLoadError(f"{where}: cannot dequantize {t.name} "
                                 f"({t.tensor_type.name}, shape {shape}): {e}") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 data is mmap-ed
        name = t.name
        if name == "token_embd.weight":
            out[pre + "embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            out[pre + "norm.weight"] = w
        elif name == "output.weight":
            out["lm_head.weight"] = w
        elif name == "rope_freqs.weight" and not bool((w == 1).all()):
            # llama.cpp keeps Llama 3.1+'s llama3 RoPE scaling only as these per-pair divisors
            out[ROPE_FREQS] = w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in names:
                continue
            if permuted and rest == "attn_q.weight":
                w = unpermute_qk(w, cfg.num_heads)
            elif permuted and rest == "attn_k.weight":
                w = unpermute_qk(w, cfg.num_kv_heads)
            out[f"{pre}layers.{idx}.{names[rest]}"] = w
    return out, "lm_head.weight" not in out
