"""llmcompressor's FP8_BLOCK checkpoint on CUDA: loaded in bf16, served from the engine's graphs,
against the same checkpoint's exact W8A8 result (fp32, reference kernels, on the CPU)."""

from __future__ import annotations

import pytest
import torch

from service.engine.core import EngineCore
from service.model.loader import load_model
from service.model.quant.fp8_linear import Fp8Linear
from tests.engine.helpers import engine_cfg
from tests.model.prefill import Prefiller
from tests.model.test_fp8_block import LABEL, checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fp8_block_checkpoint_serves_from_graphs(tmp_path):
    path = checkpoint(tmp_path)
    exact = load_model(path, "cpu", torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 130, 200)]
    want = Prefiller(exact.model).last_logits(prompts)
    loaded = load_model(path, "cuda", torch.bfloat16)
    lin = loaded.model.layers[0].qkv_proj
    assert isinstance(lin, Fp8Linear) and lin.block and lin._triton(torch.empty(1, device="cuda"))
    engine = EngineCore(engine_cfg(device="cuda", dtype="bfloat16", max_prefill_tokens=512,
                                   cuda_graph_max_tokens=512, cuda_graph_full_max_tokens=256,
                                   kv_cache_bytes=None, mem_fraction_static=0.2),
                        loaded=loaded)
    try:
        assert engine.info().quantization == LABEL
        for p, w in zip(prompts, want):
            got = engine.prefill_chunked(p).float().cpu()
            assert torch.isfinite(got).all()
            assert ((got - w).norm() / w.norm()).item() < 2e-2
        assert engine.forward_counts["graph"] == len(prompts)
    finally:
        engine.close()
