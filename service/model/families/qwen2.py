"""Qwen2/2.5: Llama's layer with a bias on Q, K and V."""

from __future__ import annotations

from typing import Any

from service.model.config import HFConfig, ModelConfig
from service.model.families.base import Family, base_hf


def from_hf(c: HFConfig, model_type: str = "qwen2") -> dict[str, Any]:
    """Qwen2 and Qwen3: full attention (no published checkpoint sets use_sliding_window)."""
    if c.get("use_sliding_window", False):
        c.refuse("use_sliding_window: true")
    return c.common(model_type, eps_default=1e-6)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    d = base_hf(cfg)
    d.pop("attention_bias")  # Qwen2 always has the bias
    return d


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    describe="Qwen2/2.5",
    from_hf=from_hf,
    to_hf=to_hf,
    traits=dict(qkv_bias=True),
    presets={
        "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    },
)
