"""llmcompressor's FP8_BLOCK checkpoint on CUDA, served from the engine's graphs in bf16: its error
against the exact W8A8 result (fp32, reference kernels) stays within 1.5x of the bf16 reference
path's, as tests/model/test_fp8_gpu.py measures the GPU path."""

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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_block_checkpoint_serves_from_graphs(tmp_path):
    path = checkpoint(tmp_path)
    exact = load_model(path, "cpu", torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 130, 200)]
    want = Prefiller(exact.model).last_logits(prompts)
    ref = Prefiller(load_model(path, "cpu", torch.bfloat16).model).last_logits(prompts)
    loaded = load_model(path, "cuda", torch.bfloat16)
    lin = loaded.model.layers[0].qkv_proj
    assert isinstance(lin, Fp8Linear) and lin.block and lin._triton(torch.empty(1, device="cuda"))
    engine = EngineCore(engine_cfg(device="cuda", dtype="bfloat16", max_prefill_tokens=512,
                                   cuda_graph_max_tokens=512, cuda_graph_full_max_tokens=256,
                                   kv_cache_bytes=None, mem_fraction_static=0.2),
                        loaded=loaded)
    try:
        assert engine.info().quantization == LABEL
        for p, w, r in zip(prompts, want, ref):
            got = engine.prefill_chunked(p).float().cpu()
            assert torch.isfinite(got).all()
            err, err_ref = _rel(got, w), _rel(r.float(), w)
            assert err <= max(1.5 * err_ref, 1e-2), f"{len(p)} tokens: {err:.3g} vs {err_ref:.3g}"
        assert engine.forward_counts["graph"] == len(prompts)
    finally:
        engine.close()
