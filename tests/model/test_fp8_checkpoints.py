"""FP8 checkpoints as published (tensor names, dtypes and quantization_config of the
compressed-tensors FP8 and the fp8-block checkpoints) load into Fp8Linear projections, bit for
bit, and run close to transformers on the dequantized weights; other schemes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant_fp8 import E4M3, dequantize, quantize_ref
from service.engine.core import EngineCore
from service.model.errors import ModelLoadError
from service.model.loader import load_model
from service.model.quant.fp8_linear import Fp8Linear, quantize_blocks
from tests.engine.helpers import engine_cfg
from tests.model.checkpoints import write_tokenizer
from tests.model.prefill import Prefiller

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True}


def compressed(weights: str, acts: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**FLOAT8, "strategy": weights, "dynamic": False},
                "input_activations": {**FLOAT8, "strategy": acts, "dynamic": acts == "token"}}}}


def block_compressed(blocks: list[int], acts: str, group: int | None) -> dict:
    """llmcompressor's FP8_BLOCK config (tests/model/data/llama-fp8-block) with other values."""
    qc = compressed("channel", "token")
    qc["config_groups"]["group_0"].update(
        weights={**FLOAT8, "strategy": "block", "block_structure": blocks, "dynamic": False},
        input_activations={**FLOAT8, "strategy": acts, "group_size": group, "dynamic": True})
    return qc


BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def base_model():
    """A tiny Llama whose projections have whole 128 x 128 blocks (q, k, v 128 rows each)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=256,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    return model


def write_fp8(path: Path, model, qc: dict, inputs: dict[str, float] | None = None) -> dict:
    """The checkpoint: every projection's weight in e4m3 with its scales named as published;
    returns the dequantized state dict (what transformers runs as the reference)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors, deq = {}, {}
    for name, t in model.state_dict().items():
        t = t.float()
        module = name.removesuffix(".weight")
        if not any(module.endswith(p) for p in PROJ):
            tensors[name] = deq[name] = t
            continue
        if qc.get("quant_method") == "fp8":
            q, s = quantize_blocks(t)
            tensors[module + ".weight_scale_inv"] = s
        else:
            strategy = qc["config_groups"]["group_0"]["weights"]["strategy"]
            if strategy == "channel":
                q, s = quantize_ref(t)
                tensors[module + ".weight_scale"] = s[:, None]  # (N, 1), as published
            else:
                s = t.abs().max() / 448.0
                q = (t / s).to(E4M3)
                tensors[module + ".weight_scale"] = s.reshape(1)
            if inputs is not None:
                tensors[module + ".input_scale"] = torch.tensor([inputs[module.rsplit(".", 1)[1]]])
        tensors[name] = q
        deq[name] = dequantize(q, s)
    save_file(tensors, str(path / "model.safetensors"))
    raw = model.config.to_dict() | {"quantization_config": qc,
                                    "architectures": ["LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(raw))
    write_tokenizer(path, 300)
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return deq


STATIC = {"q_proj": 0.02, "k_proj": 0.02, "v_proj": 0.02, "o_proj": 0.01, "gate_proj": 0.03,
          "up_proj": 0.03, "down_proj": 0.005}


@pytest.mark.parametrize("qc, inputs, label", [
    (compressed("channel", "token"), None, "weights per channel, activations per token"),
    (compressed("tensor", "token"), None, "weights per tensor, activations per token"),
    (compressed("tensor", "tensor"), STATIC,
     "weights per tensor, activations static per tensor"),
    (BLOCK_FP8, None, "weights per 128x128 block, activations per 128-column group"),
], ids=["channel-token", "tensor-token", "tensor-static", "block128"])
def test_fp8_checkpoint_loads_as_published(tmp_path, qc, inputs, label):
    import transformers

    ref = base_model()
    deq = write_fp8(tmp_path / "ckpt", ref, qc, inputs)
    ours = load_model(tmp_path / "ckpt", "cpu", torch.float32)
    engine = EngineCore(engine_cfg(), loaded=ours)  # it reports what the checkpoint holds
    assert engine.info().quantization == f"fp8 e4m3, {label}"
    engine.close()
    raw = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    layer = ours.model.layers[1]
    qkv = layer.qkv_proj
    assert isinstance(qkv, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    names = [f"model.layers.1.{p}.weight" for p in PROJ[:3]]
    assert torch.equal(qkv.weight.view(torch.uint8),  # bit for bit, stacked
                       torch.cat([raw[n] for n in names]).view(torch.uint8))
    assert (qkv.input_scale is not None) == (inputs is not None)
    assert ours.model.lm_head is not None and not isinstance(ours.model.lm_head, Fp8Linear)
    # transformers on the dequantized weights, each projection's input rounded to e4m3 as the
    # scheme says (per token, per 128-column group, or with the static scale)
    hf = transformers.LlamaForCausalLM(ref.config).eval()
    hf.load_state_dict(deq)
    torch.testing.assert_close(qkv.dequantized(), torch.cat([deq[n] for n in names]))
    for name, module in hf.named_modules():
        if name.endswith(PROJ):
            kind = name.rsplit(".", 1)[1]
            module.register_forward_pre_hook(
                lambda m, args, kind=kind: (fake_quant(args[0], qc, inputs, kind),))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (5, 40)]
    got = Prefiller(ours.model).last_logits(prompts)
    for p, row in zip(prompts, got):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


def fake_quant(x: torch.Tensor, qc: dict, inputs: dict[str, float] | None,
               kind: str) -> torch.Tensor:
    """x as the FP8 projection sees it: rounded to e4m3 with the scheme's activation scales."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if inputs is not None:
        s = torch.tensor(inputs[kind])
        back = (flat / s).clamp(-448, 448).to(E4M3).float() * s
    elif qc.get("quant_method") == "fp8":
        g = flat.view(flat.shape[0], -1, 128)
        s = g.abs().amax(-1, keepdim=True) / 448.0
        back = ((g / s).to(E4M3).float() * s).view_as(flat)
    else:
        s = flat.abs().amax(-1, keepdim=True) / 448.0
        back = (flat / s).to(E4M3).float() * s
    return back.view_as(x).to(x.dtype)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    (BLOCK_FP8 | {"weight_block_size": None}, "weight_block_size None"),
    (BLOCK_FP8 | {"activation_scheme": "static"}, "activation_scheme 'static'"),
    (compressed("channel", "token") | {"format": "int-quantized"}, "format 'int-quantized'"),
    ({**compressed("channel", "token"), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**FLOAT8, "strategy": "channel", "dynamic": False}}}},
     "weight-only"),
    ({**compressed("channel", "token"), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**FLOAT8, "strategy": "group", "group_size": 128},
        "input_activations": {**FLOAT8, "strategy": "token", "dynamic": True}}}}, "weights"),
    (block_compressed([64, 64], "group", 128), "'block_structure': \\[64, 64\\]"),
    (block_compressed([128, 128], "token", None), "input_activations .* with block weights"),
    (block_compressed([128, 128], "group", 64), "'group_size': 64"),
], ids=["awq", "fp8-no-blocks", "fp8-static", "int8", "weight-only", "group-weights",
        "block-64", "block-token", "block-group-64"])
def test_schemes_that_cannot_run_exactly_are_refused(tmp_path, qc, match):
    write_fp8(tmp_path / "ckpt", base_model(), BLOCK_FP8)
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw | {"quantization_config": qc}))
    with pytest.raises(ModelLoadError, match=match) as e:
        load_model(tmp_path / "ckpt")
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_unequal_static_scales_of_one_input_are_refused(tmp_path):
    write_fp8(tmp_path / "ckpt", base_model(), compressed("tensor", "tensor"),
              STATIC | {"k_proj": 0.05})
    with pytest.raises(ModelLoadError, match="different input_scale"):
        load_model(tmp_path / "ckpt")


def test_fp8_tensors_without_a_scheme_are_refused(tmp_path):
    write_fp8(tmp_path / "ckpt", base_model(), BLOCK_FP8)
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    raw.pop("quantization_config")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="outside a quantization scheme"):
        load_model(tmp_path / "ckpt")
