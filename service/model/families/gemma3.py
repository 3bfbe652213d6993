"""Gemma 3 (text; the multimodal checkpoints' `text_config` too): five sliding-window layers to
one global, QK-norm, sandwich (1 + w) norms, GeGLU, scaled embeddings and softmax."""

from __future__ import annotations

from typing import Any

from service.model.config import HFConfig, ModelConfig
from service.model.families.base import Family, base_hf

SLIDING_PATTERN = 6  # transformers' default: every sixth layer is global
# transformers' Gemma3TextConfig defaults: gemma-3-4b-it's text_config names only a few fields
TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, max_position_embeddings=131072, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1)


def from_hf(c: HFConfig) -> dict[str, Any]:
    raw = c.raw
    if isinstance(raw.get("text_config"), dict):  # the multimodal checkpoint's text tower
        raw = {**{k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw},
               **raw["text_config"]}
    c = HFConfig({**TEXT_DEFAULTS, **raw}, c.where)
    if c.get("use_bidirectional_attention", False):
        c.refuse("use_bidirectional_attention: true (an embedding model, not a decoder)")
    if c.get("attn_logit_softcapping") is not None:
        c.refuse("attn_logit_softcapping")
    if c.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        c.refuse(f"hidden_activation {c.get('hidden_activation')!r}")
    kw = c.common("gemma3")
    layers = kw["num_layers"]
    if c.get("layer_types") is None:
        pattern = int(c.get("sliding_window_pattern", SLIDING_PATTERN))
        c = HFConfig({**c.raw, "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(layers)]}, c.where)
    kw["rope_theta"], kw["rope_scaling"] = c.rope("full_attention")
    local_theta, local_scaling = c.rope("sliding_attention")
    if local_scaling is not None:
        c.refuse("rope scaling on the sliding-window layers")
    if c.get("rope_parameters") is None:
        local_theta = float(c.get("rope_local_base_freq", 10000.0))
    return dict(
        **kw, embed_scale=kw["hidden_size"] ** 0.5,
        attn_scale=float(c.get("query_pre_attn_scalar", kw["head_dim"])) ** -0.5,
        windows=c.layer_windows(layers), local_rope_theta=local_theta,
        final_logit_softcap=c.get("final_logit_softcapping"))


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    d = base_hf(cfg)
    windows = [w for w in cfg.windows if w]
    d.update(hidden_activation="gelu_pytorch_tanh",
             query_pre_attn_scalar=round(cfg.softmax_scale ** -2),
             sliding_window=windows[0] if windows else None,
             layer_types=["sliding_attention" if cfg.window(i) else "full_attention"
                          for i in range(cfg.num_layers)],
             rope_local_base_freq=cfg.local_rope_theta,
             final_logit_softcapping=cfg.final_logit_softcap)
    return d


def _layers(n: int, window: int) -> tuple[int, ...]:
    return tuple(window if (i + 1) % SLIDING_PATTERN else 0 for i in range(n))


def _preset(hidden: int, inter: int, layers: int, heads: int, kv: int, window: int
            ) -> dict[str, Any]:
    return dict(vocab_size=262144, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=256, rms_norm_eps=1e-6,
                rope_theta=1000000.0, local_rope_theta=10000.0, tie_word_embeddings=True,
                max_position_embeddings=32768, embed_scale=hidden ** 0.5, attn_scale=256 ** -0.5,
                windows=_layers(layers, window))


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    model_types=("gemma3_text", "gemma3"),
    describe="Gemma 3 270M-27B, text only",
    from_hf=from_hf,
    to_hf=to_hf,
    norms={"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
           "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    norm_offset=1.0,
    # Gemma3ForCausalLM; the multimodal checkpoints as transformers 4.5x and 5.x save them
    prefixes=("model.", "language_model.model.", "model.language_model."),
    traits=dict(qk_norm=True, sandwich_norms=True, activation="gelu_tanh"),
    presets={
        "gemma-3-270m": _preset(640, 2048, 18, 4, 1, 512),
        "gemma-3-1b": _preset(1152, 6912, 26, 4, 1, 512),
    },
)
