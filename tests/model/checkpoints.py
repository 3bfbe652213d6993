"""Tiny Hugging Face checkpoints written by the tests (random weights, a small BPE tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "Prefill services compute the KV cache of a prompt.",
]
GEMMA3_WINDOW = 8  # keys a windowed layer of the "gemma3" checkpoint sees, itself included


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))


def write_checkpoint(path: Path, kind: str, seed: int = 0, shards: int = 1) -> Path:
    """kind: 'llama' (untied head, Llama-3 rope scaling), 'qwen2' (QKV bias, tied), 'qwen3'
    (QK-norm, head_dim 32 over a 64 hidden of 4 heads, tied) or 'gemma3' (6 layers: two windowed
    of 8 keys then one global, twice; local RoPE base, query_pre_attn_scalar 24, logit softcap)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_theta=50000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True, rope_theta=1000000.0)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, head_dim=32, rms_norm_eps=1e-6,
            sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=24, rope_theta=1000000.0, rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    norm_mean = 0.0 if kind == "gemma3" else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():  # larger than init defaults so that mistakes show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(norm_mean, 0.1)
            else:
                p.normal_(0.0, 0.08)
    max_shard = "200KB" if shards > 1 else "100GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard)
    write_tokenizer(path, 300)
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return path
