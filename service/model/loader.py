"""One entry point: load a model + tokenizer from a HF directory or a GGUF file, no downloads."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from service.model.config import ModelConfig, model_name
from service.model.decoder import DecoderModel
from service.model.errors import ModelLoadError
from service.model.families import family, preset
from service.model.files import (
    default_model_path,
    gguf_metadata,
    read_gguf,
    read_hf_config,
    tokenizer_of,
)
from service.model.heads import is_classifier, score_head
from service.model.loader_gguf import ROPE_FREQS, config_from_gguf, gguf_tensors, rope_freq_scaling
from service.model.loader_hf import read_safetensors
from service.model.pooling import is_pooling_checkpoint
from service.model.quant import of_checkpoint
from service.model.tokenizer import TextTokenizer, load_hf_tokenizer, tokenizer_from_gguf
from service.model.weights import decoder_prefix, load_hf_state

log = logging.getLogger(__name__)

def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: TextTokenizer
    cfg: ModelConfig
    path: Path
    load_seconds: float
    lm_head: bool = True  # False: a pooling checkpoint saved without one (generation refused)


def _head_less(cfg: ModelConfig, tensors: dict, where: str, pooling: str | None, path: Path,
               raw: dict) -> tuple[ModelConfig, bool]:
    """A head-less pooling or classifier checkpoint runs its embedding as head; the API refuses
    generation."""
    if not (is_pooling_checkpoint(path, pooling) or is_classifier(raw)):
        return cfg, False
    bare = decoder_prefix(family(cfg.arch), tensors, where) == ""
    headless = bare or is_classifier(raw) or (not cfg.tie_word_embeddings
                                              and "lm_head.weight" not in tensors)
    if headless and not cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return cfg, headless


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, attn_backend: str | None = None,
               pooling: str | None = None, score: str = "auto") -> LoadedModel:
    """Load weights onto `device` in `dtype` (default: bf16 on CUDA, fp32 on CPU)."""
    t0 = time.perf_counter()
    path = Path(path) if path else default_model_path()
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    attn_backend = attn_backend or ("triton" if device.type == "cuda" else "torch")
    scheme, headless, raw, tensors = None, False, {}, {}
    if path.is_dir() and (path / "config.json").is_file():
        cfg, raw = read_hf_config(path)
        scheme = of_checkpoint(raw, str(path / "config.json"))
        tensors = read_safetensors(path)
        cfg, headless = _head_less(cfg, tensors, str(path), pooling, path, raw)
        tokenizer = load_hf_tokenizer(path, raw)
        where = str(path)
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path}: no config.json, and {len(ggufs)} .gguf files (need exactly one)")
        return load_model(ggufs[0], device, dtype, attn_backend, pooling, score)
    elif path.suffix == ".gguf" or path.is_file():
        reader = read_gguf(path)
        meta = gguf_metadata(reader)
        cfg = config_from_gguf(meta, str(path))
        tensors, tied = gguf_tensors(reader, cfg, str(path))
        cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)
        if ROPE_FREQS in tensors:
            cfg = dataclasses.replace(cfg, rope_scaling=rope_freq_scaling(tensors[ROPE_FREQS]))
        tokenizer = tokenizer_from_gguf(meta, str(path))
        where = str(path)
    else:
        raise ModelLoadError(f"{path}: no such model file or directory")

    with torch.device("meta"):
        model = DecoderModel(cfg, attn_backend=attn_backend)
    model = model.to_empty(device=device).to(dtype)
    model.build_rope_tables(device)  # fp32; to_empty() left the buffers uninitialised
    load_hf_state(model, tensors, where, scheme)
    if head := score_head(score, raw, tensors, model.head_weight, tokenizer, where):
        model.score_head = dataclasses.replace(head, weight=head.weight.to(device))
    model.eval()
    model.set_kernels(device.type == "cuda")
    secs = time.perf_counter() - t0
    log.info("loaded %s from %s (%s, %d layers) on %s in %s in %.2fs", model_name(str(path)),
             path, cfg.arch, cfg.num_layers, device, dtype, secs)
    return LoadedModel(model, tokenizer, cfg, path, secs, not headless)


def random_model(cfg: ModelConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, attn_backend: str | None = None,
                 seed: int = 0) -> DecoderModel:
    """A model of `cfg`'s shape with random weights (benchmarks and GPU tests)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = DecoderModel(cfg, attn_backend or ("triton" if device.type == "cuda" else "torch"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.05)
            else:
                p.normal_(0.0, 0.02)
    model = model.to(dtype).eval()
    model.build_rope_tables(device)
    model.set_kernels(device.type == "cuda")
    return model


def load(path: str | None, preset_name: str | None, device: torch.device,
         dtype: torch.dtype, pooling: str | None = None, score: str = "auto") -> LoadedModel:
    """The checkpoint at `path`, or random `preset_name` weights with its tokenizer."""
    if preset_name is None:
        return load_model(path, device, dtype, pooling=pooling, score=score)
    t0 = time.perf_counter()
    where = Path(path) if path else default_model_path()
    cfg = preset(preset_name)
    model, tokenizer = random_model(cfg, device, dtype), tokenizer_of(where)
    if head := score_head(score, {}, {}, model.head_weight, tokenizer, str(where)):
        model.score_head = dataclasses.replace(head, weight=head.weight.to(device))
    return LoadedModel(model, tokenizer, cfg, where, time.perf_counter() - t0)
