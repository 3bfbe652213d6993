"""The architecture registry against real checkpoints' config.json files: each maps to the
ModelConfig of the published model, each preset is its checkpoint's shape, transformers reads
`hf_dict` as we do, configs saved by transformers 5 read the same, and what the decoder cannot
run is refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from service.model.config import ModelConfig
from service.model.errors import ModelLoadError, UnsupportedArchitecture
from service.model.families import FAMILIES, PRESETS, config_from_hf, hf_dict, preset

# --- config.json as published (the fields every reader needs, verbatim) -------------------------

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_8B = {
    **QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "tie_word_embeddings": False,
}
GEMMA3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
GEMMA3_270M = {
    "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512,
    "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
    "use_bidirectional_attention": False, "use_cache": True, "vocab_size": 262144,
}
# The multimodal checkpoint names few text fields: transformers' Gemma3TextConfig defaults
# (vocab 262208, 8 heads, 4 KV heads, head_dim 256, ...) fill in the rest.
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
        "patch_size": 14, "vision_use_head": False,
    },
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 151936,
}

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _gemma_windows(layers: int, window: int) -> tuple[int, ...]:
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers))


# checkpoint -> (config.json, its preset or None, the fields it must map to)
REAL = {
    "Qwen/Qwen3-0.6B": (QWEN3_0_6B, "qwen3-0.6b", dict(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, windows=(), local_rope_theta=None, attn_scale=None,
        embed_scale=1.0, tie_word_embeddings=True, qk_norm=True, sandwich_norms=False,
        qkv_bias=False, activation="silu", max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645)),
    "Qwen/Qwen3-8B": (QWEN3_8B, "qwen3-8b", dict(
        arch="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, tie_word_embeddings=False, qk_norm=True, windows=())),
    "google/gemma-3-1b-it": (GEMMA3_1B_IT, "gemma-3-1b", dict(
        arch="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, windows=_gemma_windows(26, 512),
        local_rope_theta=1e4, attn_scale=256**-0.5, embed_scale=1152**0.5,
        tie_word_embeddings=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
        final_logit_softcap=None, max_position_embeddings=32768, bos_token_id=2,
        eos_token_id=1)),
    "google/gemma-3-270m": (GEMMA3_270M, "gemma-3-270m", dict(
        arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
        windows=_gemma_windows(18, 512), local_rope_theta=1e4, rope_theta=1e6,
        attn_scale=256**-0.5, embed_scale=640**0.5, tie_word_embeddings=True)),
    "google/gemma-3-4b-it": (GEMMA3_4B_IT, None, dict(
        arch="gemma3", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
        windows=_gemma_windows(34, 1024), local_rope_theta=1e4, attn_scale=256**-0.5,
        embed_scale=2560**0.5, tie_word_embeddings=True, qk_norm=True, sandwich_norms=True,
        activation="gelu_tanh", max_position_embeddings=131072, bos_token_id=2,
        eos_token_id=1)),
    "meta-llama/Llama-3.1-8B": (LLAMA_3_1_8B, "llama-3.1-8b", dict(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=5e5, rope_scaling=LLAMA3_SCALING, windows=(), local_rope_theta=None,
        attn_scale=None, embed_scale=1.0, tie_word_embeddings=False, qk_norm=False,
        sandwich_norms=False, qkv_bias=False, activation="silu",
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001)),
    "Qwen/Qwen2.5-0.5B": (QWEN2_5_0_5B, "qwen2.5-0.5b", dict(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1e6, windows=(), qkv_bias=True, qk_norm=False, tie_word_embeddings=True,
        max_position_embeddings=32768)),
}

# What a preset must share with its checkpoint: every field that shapes the computation
SHAPE = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
         "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "windows",
         "local_rope_theta", "tie_word_embeddings", "qkv_bias", "attn_scale", "embed_scale",
         "qk_norm", "sandwich_norms", "activation", "final_logit_softcap")


def _shape(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in SHAPE}


@pytest.mark.parametrize("name", list(REAL))
def test_real_config_maps_to_the_published_model(name):
    raw, _, want = REAL[name]
    cfg = config_from_hf(json.loads(json.dumps(raw)), f"{name}/config.json")
    assert {k: getattr(cfg, k) for k in want} == want


def test_every_preset_with_a_real_config_is_its_checkpoint():
    covered = {p for _, p, _ in REAL.values() if p}
    assert covered <= set(PRESETS)
    for name, (raw, p, _) in REAL.items():
        if p:
            assert _shape(preset(p)) == _shape(config_from_hf(raw, name)), p


def _shrunk(cfg: ModelConfig, layers: int = 6) -> ModelConfig:
    return replace(cfg, num_layers=layers, vocab_size=256,
                   windows=cfg.windows[:layers] if cfg.windows else ())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_round_trips_through_hf_dict_and_transformers(name):
    import transformers

    cfg = preset(name)
    assert _shape(config_from_hf(hf_dict(cfg), name)) == _shape(cfg)
    small = _shrunk(cfg)
    d = hf_dict(small)
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    # transformers' own reading of the dict, written back, is the same model
    assert _shape(config_from_hf(hf_cfg.to_dict(), name)) == _shape(small)
    with torch.device("meta"):
        twin = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    assert type(twin).__name__ == hf_dict(small)["architectures"][0]
    assert sum(p.numel() for p in twin.parameters()) == small.num_params()


# --- configs as transformers 5 saves them (rope_parameters, possibly per layer type) ----------

def _saved(tmp_path, hf_cfg) -> dict:
    hf_cfg.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_transformers5_gemma3_text_config(tmp_path):
    import transformers

    hf = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 12345.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 999.0}})
    raw = _saved(tmp_path, hf)
    assert "rope_parameters" in raw and "rope_theta" not in raw
    cfg = config_from_hf(raw)
    assert cfg.windows == (8, 8, 8, 8, 8, 0, 8)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (12345.0, 999.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attn_scale == 24**-0.5 and cfg.head_dim == 16 and cfg.tie_word_embeddings


def test_transformers5_gemma3_multimodal_config(tmp_path):
    import transformers

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 500.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
    raw = _saved(tmp_path, transformers.Gemma3Config(text_config=text))
    assert "vision_config" in raw and "text_config" in raw
    cfg = config_from_hf(raw)
    assert cfg.arch == "gemma3" and cfg.vocab_size == 300 and cfg.windows == (8, 0, 8)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (500.0, 50.0, None)


def test_transformers5_qwen3_config(tmp_path):
    import transformers

    hf = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, rope_theta=77777.0)
    raw = _saved(tmp_path, hf)
    cfg = config_from_hf(raw)
    assert cfg.arch == "qwen3" and cfg.qk_norm and cfg.head_dim == 32
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.windows) == (77777.0, None, ())


def test_transformers5_llama3_scaling_config(tmp_path):
    import transformers

    hf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=131072,
                                  rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    raw = _saved(tmp_path, hf)
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    cfg = config_from_hf(raw)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == LLAMA3_SCALING  # the same as the legacy config.json's
    assert cfg.rope_scaling == config_from_hf(LLAMA_3_1_8B).rope_scaling


# --- refusals: one line that names the problem -----------------------------------------------

def _refused(raw: dict, match: str, exc=ModelLoadError) -> str:
    with pytest.raises(exc, match=match) as e:
        config_from_hf(raw, "ckpt/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ckpt/config.json: ")
    return msg


@pytest.mark.parametrize("raw, match", [
    ({**GEMMA3_270M, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA3_1B_IT, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({**GEMMA3_4B_IT, "text_config": {**GEMMA3_4B_IT["text_config"],
                                      "use_bidirectional_attention": True}},
     "use_bidirectional_attention"),
    ({**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 32768}}, "'yarn'"),
    ({**QWEN3_0_6B, "rope_scaling": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
        "original_max_position_embeddings": 32768}}, "'yarn'"),
    ({**QWEN2_5_0_5B, "use_sliding_window": True}, "use_sliding_window"),
    ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
], ids=["gemma-bidirectional", "gemma-attn-softcap", "gemma-mm-bidirectional", "yarn",
        "yarn-rope-parameters", "qwen2-sliding", "qwen3-sliding"])
def test_refusals_name_the_problem(raw, match):
    assert "not supported" in _refused(raw, match)


def test_unknown_architecture_lists_every_family():
    msg = _refused({"architectures": ["MambaForCausalLM"], "model_type": "mamba"},
                   "MambaForCausalLM", UnsupportedArchitecture)
    for f in FAMILIES.values():
        assert all(a in msg for a in f.architectures), f.name


# --- Gemma3ForConditionalGeneration's text tensors under their multimodal prefix --------------

@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_gemma_state_dict_loads_as_the_text_one(prefix):
    import transformers

    from service.model.loader import random_model
    from service.model.weights import load_hf_state
    from tests.model.prefill import Prefiller

    cfg = preset("gemma-3-270m", vocab_size=320, hidden_size=64, intermediate_size=96,
                 num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, windows=(4, 4, 0),
                 embed_scale=8.0, attn_scale=16**-0.5)
    d = hf_dict(cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(d.pop("model_type"), **d))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    plain = hf.state_dict()
    head = "language_model.lm_head." if prefix == "language_model.model." else "lm_head."
    renamed = {(prefix + k[len("model."):] if k.startswith("model.")
                else head + k[len("lm_head."):]): v for k, v in plain.items()}
    renamed["model.vision_tower.x"] = torch.zeros(3)
    assert not any(k.startswith("model.layers") for k in renamed)

    prompts = [[5, 17, 300, 2, 9, 41, 77, 3, 8], [11, 12]]
    logits = []
    for sd in (plain, renamed):
        model = random_model(cfg, "cpu", torch.float32, seed=1)
        load_hf_state(model, sd, "ckpt")
        logits.append(Prefiller(model).last_logits(prompts))
    for a, b in zip(*logits):
        assert torch.isfinite(a).all() and torch.equal(a, b)
