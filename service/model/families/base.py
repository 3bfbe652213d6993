"""What a family module declares (`Family`), and the config.json fields all families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.model.config import HFConfig, ModelConfig

# The decoder's norms, named as most families' checkpoints name them (layer-relative)
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures` entries this family serves
    model_types: tuple[str, ...]  # config.json `model_type` values (when architectures is absent)
    describe: str  # the checkpoints it covers, for error messages and the README
    # ModelConfig fields of a config.json, `traits` aside (the registry adds them)
    from_hf: Callable[[HFConfig], dict[str, Any]]
    # config.json fields of a checkpoint of this shape, architectures and model_type aside (the
    # registry adds them): transformers' twin in tests and benchmarks
    to_hf: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: base_hf(cfg)
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    norm_offset: float = 0.0  # checkpoint norm weights w scale by (norm_offset + w)
    prefixes: tuple[str, ...] = ("model.",)  # where the decoder's tensors sit in the checkpoint
    gguf_arch: str | None = None  # llama.cpp's name for it; None: no GGUF loading
    gguf_permuted_qk: bool = False  # llama.cpp stores Q/K rows interleaved (its llama arch)
    traits: dict[str, Any] = field(default_factory=dict)  # fixed ModelConfig fields (GGUF too)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)


def base_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields every family writes the same way."""
    d = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
             intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
             max_position_embeddings=cfg.max_position_embeddings,
             tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.qkv_bias)
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        d["eos_token_id"] = cfg.eos_token_id
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d
