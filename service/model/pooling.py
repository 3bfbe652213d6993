"""How a checkpoint pools, as sentence-transformers reads it; POOLING and NORMALIZE over it."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from service.model.errors import ModelLoadError

log = logging.getLogger(__name__)

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    mode: str = ""  # "" (no pooling), last, mean or cls
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka: bool = False  # config.json's is_matryoshka or matryoshka_dimensions (vLLM's gate)
    matryoshka_dims: tuple[int, ...] | None = None


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def from_checkpoint(path: Path) -> Pooling:
    """modules.json's Pooling and Normalize modules; none when the checkpoint has no such file."""
    path = Path(path)  # a str where a test or bench hands EngineCore its own LoadedModel
    raw = _json(path / "config.json") if (path / "config.json").is_file() else {}
    dims = raw.get("matryoshka_dimensions") or None
    mrl = dict(matryoshka=bool(dims or raw.get("is_matryoshka")),
               matryoshka_dims=tuple(dims) if dims else None)
    if not path.is_dir() or not (path / "modules.json").is_file():
        return Pooling(**mrl)
    modules = {m.get("type"): m.get("path", "") for m in _json(path / "modules.json")}
    mode = ""
    if _POOLING in modules:
        cfg = _json(path / modules[_POOLING] / "config.json")
        modes = [ours for key, ours in _MODES.items() if cfg.get(key)]
        others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
                  and k not in _MODES]
        if others or len(modes) != 1:
            raise ModelLoadError(f"{path}: pooling {others or modes} is not served; set POOLING "
                                 "to last, mean or cls")
        mode = modes[0]
    st = path / "config_sentence_transformers.json"
    extra = _json(st) if st.is_file() else {}
    return Pooling(mode, _NORMALIZE in modules, dict(extra.get("prompts") or {}),
                   extra.get("default_prompt_name"), **mrl)


def resolve(path: Path, pooling: str | None, normalize: bool | None) -> Pooling:
    """The checkpoint's pooling with the POOLING and NORMALIZE settings over it, logged once."""
    ckpt = from_checkpoint(path)
    mode = ckpt.mode if pooling is None else ("" if pooling == "none" else pooling)
    norm = ckpt.normalize if normalize is None else normalize
    out = dataclasses.replace(ckpt, mode=mode, normalize=norm and bool(mode))
    if mode:
        log.info("pooling: %s%s (%s), /v1/embeddings served", mode,
                 ", L2-normalized" if out.normalize else "",
                 "POOLING" if pooling is not None else "the checkpoint's sentence-transformers "
                 "files")
    return out


def is_pooling_checkpoint(path: Path, pooling: str | None) -> bool:
    """Whether a missing lm_head is expected: the checkpoint (or POOLING) makes it an embedder."""
    return (pooling not in (None, "none")) or (path.is_dir() and (path / "modules.json").is_file())
