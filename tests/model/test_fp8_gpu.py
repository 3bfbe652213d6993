"""FP8 on CUDA: the Triton quantization kernels and FP8 GEMMs against the FP8 reference path.

As tests/model/test_model_gpu.py measures bf16: the same quantized model run in fp32 with the
reference kernels is the exact FP8 result; the bf16 reference path and the bf16 GPU path are
each measured against it, and the GPU path must stay within 1.5x of the reference path's error
(the bf16 path's own rounding: activations rounded to bf16 before they are quantized). Both
weight formats: per-channel (quantized at load) and 128 x 128 blocks (as FP8 checkpoints ship).
Then the engine: QUANTIZATION=fp8 on CUDA sizes its pool after capture and answers like its
eager forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from service.model.attention import AttentionBackend
from service.model.families import preset
from service.model.loader import random_model
from service.model.quant import replace_projections
from service.model.quant.fp8 import Fp8, quantize_model
from service.model.quant.fp8_linear import Fp8Linear, quantize_blocks
from tests.model.prefill import Prefiller

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _quantize(model: nn.Module, fmt: str) -> nn.Module:
    if fmt == "channel":
        quantize_model(model)
        return model
    replace_projections(model, lambda lin: Fp8Linear(
        *quantize_blocks(lin.weight.data), None if lin.bias is None else lin.bias.data))
    model.scheme = Fp8("block", "group", "weight_scale_inv")
    return model


def _use(model: nn.Module, triton: bool) -> None:
    model.attn = AttentionBackend("triton" if triton else "torch", model.cfg)
    model.set_kernels(triton)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name,fmt", [("llama-3.2-1b", "channel"), ("qwen2.5-0.5b", "channel"),
                                      ("llama-3.2-1b", "block"), ("gemma-3-1b", "channel")])
def test_the_gpu_path_matches_the_fp8_reference(name, fmt):
    cfg = preset(name, num_layers=4)
    m32 = random_model(cfg, "cuda", torch.float32, seed=1)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    m16.build_rope_tables(torch.device("cuda"))
    _quantize(m32, fmt)
    _quantize(m16, fmt)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in [1, 31, 320, 1008]]  # 1,360 rows: block weights take cuBLASLt
    _use(m32, False)
    exact = Prefiller(m32, tokens=4096).last_logits(prompts)
    _use(m16, False)
    ref = Prefiller(m16, tokens=4096).last_logits(prompts)
    _use(m16, True)
    for lin in m16.modules():
        if isinstance(lin, Fp8Linear):
            assert lin._triton(torch.empty(1, device="cuda"))
    out = Prefiller(m16, tokens=4096).last_logits(prompts)
    for e, r, o in zip(exact, ref, out):
        e, r, o = e.float(), r.float(), o.float()
        assert torch.isfinite(o).all()
        err_ref, err_out = _rel(r, e), _rel(o, e)
        assert err_out <= max(1.5 * err_ref, 1e-2), (
            f"{name} {fmt}: GPU path {err_out:.3g} vs fp32 FP8, reference {err_ref:.3g}")


def test_an_fp8_engine_on_cuda_serves_from_graphs():
    """QUANTIZATION=fp8 on CUDA: weights shrink, the KV pool is sized after capture, and a
    graph-run prefill answers as the same engine's eager forward does."""
    from service.engine.core import EngineCore
    from service.model.loader import LoadedModel
    from tests.engine.helpers import engine_cfg

    cfg = preset("llama-3.2-1b", num_layers=4)
    model = random_model(cfg, "cuda", torch.bfloat16, seed=3)
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    projections = sum(lin.weight.numel() * 2 for lin in model.modules()
                      if isinstance(lin, nn.Linear))  # the embedding (tied head) stays bf16
    loaded = LoadedModel(model, None, cfg, "random", 0.0)
    engine = EngineCore(engine_cfg(quantization="fp8", device="cuda", dtype="bfloat16",
                                   max_prefill_tokens=2048, cuda_graph_max_tokens=2048,
                                   cuda_graph_full_max_tokens=512, kv_cache_bytes=None,
                                   mem_fraction_static=0.3),
                        loaded=loaded)
    try:
        info = engine.info()
        assert info.quantization == "fp8 e4m3, weights per channel, activations per token"
        # e4m3 projections: half their bytes, plus an fp32 scale per output channel
        assert info.memory.weights_bytes < bf16_bytes - 0.45 * projections
        assert info.memory.kv_tokens > 0 and info.memory.capture_bytes > 0
        prompt = torch.randint(0, cfg.vocab_size, (300,)).tolist()
        graph = engine.prefill_chunked(prompt)
        assert engine.forward_counts["graph"] > 0
        eager = Prefiller(engine.model, page_size=16).last_logits([prompt])[0]
        assert _rel(graph.float(), eager.float()) < 1e-2
    finally:
        engine.close()
