"""Load a Hugging Face checkpoint directory: config.json, (sharded) safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from service.model.errors import ModelLoadError


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: bad safetensors index ({e})") from e
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(
            f"{model_dir}: no weights (expected model.safetensors or model.safetensors.index.json)")
    return [single]


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors (truncated or corrupt?): {e}"
                                 ) from e
    return tensors
