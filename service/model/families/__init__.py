"""The architecture registry: a family (a module here listed in `_modules`, or `register()`ed)
maps its checkpoints onto a ModelConfig and the decoder's weights; the engine never sees one."""

from __future__ import annotations

from typing import Any

from service.model.config import HFConfig, ModelConfig
from service.model.errors import ModelLoadError, UnsupportedArchitecture
from service.model.families.base import Family


def _modules() -> list[Family]:
    from service.model.families import gemma3, llama, qwen2, qwen3

    return [llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY]


FAMILIES: dict[str, Family] = {}
PRESETS: dict[str, dict[str, Any]] = {}


def register(f: Family) -> None:
    """Serve family `f` (one defined outside this package) and its presets."""
    unregister(f.name)
    FAMILIES[f.name] = f
    PRESETS.update({name: {"arch": f.name, **f.traits, **shape}
                    for name, shape in f.presets.items()})


def unregister(name: str) -> None:
    f = FAMILIES.pop(name, None)
    for p in f.presets if f else ():
        PRESETS.pop(p, None)


for _f in _modules():
    register(_f)


def family(name: str) -> Family:
    return FAMILIES[name]


def supported() -> str:
    return "; ".join(f"{', '.join(f.architectures)} ({f.describe})" for f in FAMILIES.values())


def gguf_archs() -> list[str]:
    return [f.gguf_arch for f in FAMILIES.values() if f.gguf_arch]


def config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a checkpoint's config.json, or UnsupportedArchitecture."""
    archs = raw.get("architectures") or []
    # the bare decoder (LlamaModel, Qwen3Model) as sentence-transformers saves it: by model_type
    by_type = all(str(a).endswith(("Model", "ForSequenceClassification")) for a in archs)
    for f in FAMILIES.values():
        if any(a in f.architectures for a in archs) or (
                by_type and raw.get("model_type") in f.model_types):
            return ModelConfig(**{**f.from_hf(HFConfig(raw, where)), **f.traits})
    raise UnsupportedArchitecture(
        f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; supported: "
        f"{supported()}")


def family_for_gguf(arch: Any, where: str) -> Family:
    for f in FAMILIES.values():
        if f.gguf_arch is not None and f.gguf_arch == arch:
            return f
    raise UnsupportedArchitecture(
        f"{where}: unsupported GGUF architecture {arch!r}; supported: {', '.join(gguf_archs())}")


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A real checkpoint's shape, for random-weight benchmarks and GPU tests."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    shape = {**PRESETS[name], **overrides}
    if shape.get("windows") and "windows" not in overrides:  # fewer layers: the first ones
        shape["windows"] = shape["windows"][: shape["num_layers"]]
    return ModelConfig(name=name, **shape)


def hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of a checkpoint of `cfg`'s shape (its family's mapping, inverted)."""
    f = family(cfg.arch)
    return {"architectures": [f.architectures[0]], "model_type": f.model_types[0],
            **f.to_hf(cfg)}
