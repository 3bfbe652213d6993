"""What a family module declares (`Family`), and the config.json fields all families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.model.config import HFConfig, ModelConfig

# The decoder's norms and projection slots, named as Llama's checkpoints name them (layer-relative)
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
LLAMA_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
LLAMA_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                     "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                     "down": "mlp.down_proj"}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures` entries this family serves
    model_types: tuple[str, ...]  # config.json `model_type` values (when architectures is absent)
    describe: str  # the checkpoints it covers, for error messages and the README
    from_hf: Callable[[HFConfig], dict[str, Any]]
    # config.json fields of this shape but architectures and model_type: transformers' twin in tests
    to_hf: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: base_hf(cfg)
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    qk_norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_QK_NORMS))
    projections: dict[str, str] = field(default_factory=lambda: dict(LLAMA_PROJECTIONS))
    norm_offset: float = 0.0  # checkpoint norm weights w scale by (norm_offset + w)
    prefixes: tuple[str, ...] = ("model.",)  # where the decoder's tensors sit in the checkpoint
    gguf_arch: str | None = None  # llama.cpp's name for it; None: no GGUF loading
    gguf_permuted_qk: bool = False  # llama.cpp stores Q/K rows interleaved (its llama arch)
    traits: dict[str, Any] = field(default_factory=dict)  # fixed ModelConfig fields (GGUF too)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert set(self.projections) == set(LLAMA_PROJECTIONS), (
            f"family {self.name}: projections must name {', '.join(LLAMA_PROJECTIONS)}")


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
