"""Llama 2/3/3.1/3.2 and SmolLM/SmolLM2: the decoder with nothing added."""

from __future__ import annotations

from service.model.families.base import Family

LLAMA3_8K = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    describe="Llama 2/3, SmolLM/SmolLM2",
    from_hf=lambda c: c.common("llama"),
    gguf_arch="llama",
    gguf_permuted_qk=True,
    presets={
        "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                             rope_theta=100000.0, tie_word_embeddings=True),
        "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                             rope_theta=500000.0, tie_word_embeddings=True,
                             rope_scaling={**LLAMA3_8K, "factor": 32.0},
                             max_position_embeddings=131072),
        "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope_theta=500000.0, rope_scaling={**LLAMA3_8K, "factor": 8.0},
                             max_position_embeddings=131072),
    },
)
