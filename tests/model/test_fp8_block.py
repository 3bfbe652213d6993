"""llmcompressor's FP8_BLOCK checkpoint (tests/model/data/llama-fp8-block, made by
make_fp8_block.py): compressed-tensors 128 x 128 block weights with dynamic 1 x 128 group
activations load as published and match the exact W8A8 arithmetic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from service.engine.core import EngineCore
from service.model.loader import load_model
from service.model.quant import of_checkpoint
from service.model.quant.fp8_linear import Fp8Linear
from tests.engine.helpers import engine_cfg
from tests.model.checkpoints import write_tokenizer
from tests.model.prefill import Prefiller

DATA = Path(__file__).resolve().parent / "data" / "llama-fp8-block"
LABEL = "fp8 e4m3, weights per 128x128 block, activations per 128-column group"
E4M3 = torch.float8_e4m3fn


def checkpoint(tmp_path: Path) -> Path:
    """The committed checkpoint with a tokenizer beside it (the loader needs one)."""
    path = shutil.copytree(DATA, tmp_path / "ckpt")
    write_tokenizer(path, 300)
    return path


def dequantized() -> dict[str, torch.Tensor]:
    """fp32 weights: each e4m3 value times its 128 x 128 tile's scale."""
    raw, out = load_file(str(DATA / "model.safetensors")), {}
    for name, t in raw.items():
        if name.endswith(".weight_scale"):
            continue
        scale = raw.get(name + "_scale")
        if scale is None:
            out[name] = t.float()
            continue
        full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        out[name] = t.float() * full[: t.shape[0], : t.shape[1]]
    return out


def group_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the scheme reads it: each token's 128-column groups rounded to e4m3, amax / 448."""
    g = x.float().reshape(-1, x.shape[-1] // 128, 128)
    s = g.abs().amax(-1, keepdim=True) / 448.0
    return ((g / s).to(E4M3).float() * s).reshape(x.shape)


def test_the_exact_config_llmcompressor_writes_is_chosen():
    raw = json.loads((DATA / "config.json").read_text())
    w = raw["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["block_structure"]) == ("block", [128, 128])
    scheme = of_checkpoint(raw, "config.json")
    assert (scheme.weights, scheme.activations, scheme.label) == ("block", "group", LABEL)


def test_fp8_block_matches_the_exact_w8a8_reference(tmp_path):
    import transformers

    ours = load_model(checkpoint(tmp_path), "cpu", torch.float32)
    layer = ours.model.layers[0]
    assert isinstance(layer.qkv_proj, Fp8Linear) and layer.qkv_proj.block
    assert ours.model.scheme.label == LABEL
    raw = json.loads((DATA / "config.json").read_text())
    raw.pop("quantization_config")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(raw)).float().eval()
    missing, unexpected = hf.load_state_dict(dequantized(), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the head is tied
    for name, module in hf.named_modules():
        if name.endswith("_proj"):
            module.register_forward_pre_hook(lambda m, args: (group_quantized(args[0]),))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 37)]
    for p, row in zip(prompts, Prefiller(ours.model).last_logits(prompts)):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
    engine = EngineCore(engine_cfg(quantization="fp8"), loaded=ours)  # the checkpoint's wins
    try:
        assert engine.info().quantization == LABEL
    finally:
        engine.close()
