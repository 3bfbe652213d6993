"""Qwen3 (dense): Llama's layer with QK-norm before RoPE and a head_dim of its own."""

from __future__ import annotations

from typing import Any

from service.model.config import HFConfig
from service.model.families import qwen2
from service.model.families.base import Family


def from_hf(c: HFConfig) -> dict[str, Any]:
    return qwen2.from_hf(c, "qwen3")


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    describe="Qwen3 dense 0.6B-32B, Qwen3-Reranker/Embedding bases",
    from_hf=from_hf,
    gguf_arch="qwen3",
    traits=dict(qk_norm=True),
    presets={
        "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                           rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                           max_position_embeddings=40960),
        "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960),
    },
)
