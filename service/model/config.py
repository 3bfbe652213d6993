"""Model hyper-parameters: one frozen dataclass whose fields say what differs between
families' layers, so the decoder has no `if family`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from service.model.errors import ModelLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACTIVATIONS = ("silu", "gelu_tanh")


def model_name(path: str | None, preset: str | None = None) -> str:
    """The model's name in logs and the API: `random-<preset>`, or the file stem / dir name."""
    if preset:
        return f"random-{preset}"
    p = PurePath(path or DEFAULT_GGUF)
    return p.stem if p.suffix == ".gguf" else p.name


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the family: a key of service.model.families.FAMILIES
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
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    sandwich_norms: bool = False  # the attention and MLP outputs are normed before the residual
    activation: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float = 1.0  # embeddings are multiplied by this (rounded to the model's dtype)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # per layer: the attention window in keys (0: global, causal over the whole prompt)
    windows: tuple[int, ...] = ()
    # RoPE of the windowed layers where it differs from the global layers' (Gemma 3)
    local_rope_theta: float | None = None
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"activation {self.activation!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if self.windows and len(self.windows) != self.num_layers:
            raise ModelLoadError(f"{len(self.windows)} layer windows for {self.num_layers} layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees, itself included; 0: all before it (global)."""
        return self.windows[layer] if self.windows else 0

    @property
    def num_windowed_layers(self) -> int:
        return sum(1 for w in self.windows if w)

    def kv_bytes_per_token(self, dtype_bytes: int, windowed_only: bool = False) -> int:
        """K and V bytes of one token in every layer (or the windowed ones, which keep every
        token too: the pool has one layout)."""
        layers = self.num_windowed_layers if windowed_only else self.num_layers
        return layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self, include_embedding: bool = True) -> int:
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        layer = attn + 3 * h * f + norms
        n = self.num_layers * layer + h
        if include_embedding:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        elif not self.tie_word_embeddings:
            n += self.vocab_size * h  # the LM head is a real matmul even when embedding is not
        return n


class HFConfig:
    """A checkpoint's config.json, read with the file's name in every error."""

    def __init__(self, raw: dict[str, Any], where: str = "config.json"):
        self.raw, self.where = raw, where

    def need(self, key: str) -> Any:
        if self.raw.get(key) is None:
            raise ModelLoadError(f"{self.where}: missing required key {key!r}")
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        v = self.raw.get(key)
        return default if v is None else v

    def refuse(self, what: str) -> None:
        raise ModelLoadError(f"{self.where}: {what} is not supported")

    def rope(self, kind: str | None = None) -> tuple[float, dict[str, Any] | None]:
        """(rope_theta, scaling or None) of `kind` layers, transformers 4 or 5 style."""
        params = self.get("rope_parameters", {})
        if kind is not None and isinstance(params.get(kind), dict):
            params = params[kind]
        scaling = self.get("rope_scaling") if kind in (None, "full_attention") else None
        if scaling is None and params.get("rope_type") not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = params.get("rope_theta") or self.get("rope_theta", 10000.0)
        if scaling is not None:
            kind_ = scaling.get("rope_type", scaling.get("type"))
            if kind_ in (None, "default"):
                scaling = None
            elif kind_ not in ("llama3", "linear"):
                raise ModelLoadError(f"{self.where}: rope_scaling type {kind_!r} is not "
                                     "supported (supported: llama3, linear)")
        return float(theta), dict(scaling) if scaling else None

    def common(self, arch: str, eps_default: float = 1e-5) -> dict[str, Any]:
        """The fields every family reads the same way."""
        hidden, heads = int(self.need("hidden_size")), int(self.need("num_attention_heads"))
        theta, scaling = self.rope()
        eos = self.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return dict(
            arch=arch,
            vocab_size=int(self.need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(self.need("intermediate_size")),
            num_layers=int(self.need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(self.get("num_key_value_heads", heads)),
            head_dim=int(self.get("head_dim", hidden // heads)),
            rms_norm_eps=float(self.get("rms_norm_eps", eps_default)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(self.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", False)),
            qkv_bias=bool(self.get("attention_bias", False)),
            bos_token_id=self.get("bos_token_id"),
            eos_token_id=eos,
            name=str(self.get("_name_or_path") or self.get("model_type") or arch),
        )

    def layer_windows(self, num_layers: int) -> tuple[int, ...]:
        """Per-layer windows from `layer_types`; () when every layer is global."""
        types = self.get("layer_types")
        if types is None:
            return ()
        if len(types) != num_layers:
            raise ModelLoadError(f"{self.where}: {len(types)} layer_types for {num_layers} layers")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelLoadError(f"{self.where}: layer types {unknown} are not supported")
        if "sliding_attention" not in types:
            return ()
        window = int(self.need("sliding_window"))
        return tuple(window if t == "sliding_attention" else 0 for t in types)
