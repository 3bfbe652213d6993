"""QUANTIZATION=fp8: the engine quantizes the loaded projections (norms unfolded), reports it,
and serves close to the unquantized model (the GPU path: tests/model/test_fp8_gpu.py)."""

from __future__ import annotations

import torch

from service.engine.core import EngineCore
from service.model.quant.fp8 import quantize_model
from service.model.quant.fp8_linear import Fp8Linear
from tests.engine.helpers import Runners, engine_cfg, tiny_loaded
from tests.model.prefill import Prefiller


def test_fp8_engine_quantizes_unfolded_weights_and_says_so():
    prompt = list(range(3, 40))
    plain = EngineCore(engine_cfg(), loaded=tiny_loaded(seed=4))
    fp8 = EngineCore(engine_cfg(quantization="fp8"), loaded=tiny_loaded(seed=4))
    try:
        assert plain.info().quantization == "none"
        assert fp8.info().quantization == ("fp8 e4m3, weights per channel, activations per "
                                           "token")
        layer = fp8.model.layers[0]
        assert plain.model.norms_folded and not fp8.model.norms_folded
        assert isinstance(layer.qkv_proj, Fp8Linear)
        assert isinstance(layer.mlp.gate_up_proj, Fp8Linear)
        want, got = plain.prefill_chunked(prompt), fp8.prefill_chunked(prompt)
        assert 0 < ((got - want).norm() / want.norm()).item() < 0.05
    finally:
        plain.close()
        fp8.close()


def test_fp8_graph_runner_quantizes_into_its_static_scratch():
    """The breakable runner's buffers carry the scratch the FP8 scheme declares (the CUDA
    graphs' fixed addresses); its forward answers as the eager one does."""
    model = tiny_loaded(seed=5).model
    quantize_model(model)
    runners = Runners(model, buckets=[8, 32])
    try:
        bufs, c = runners.breakable.bufs, model.cfg
        assert bufs.qin.values.numel() == 32 * max(c.hidden_size, c.q_size)
        assert bufs.qin_mlp.values.numel() == bufs.mlp_rows * c.intermediate_size
        ids = list(range(7, 27))
        eager = Prefiller(model)
        logits, _, mode = runners.prefill([eager.chunk(ids)], eager.pool.cache)
        assert mode == "graph"
        torch.testing.assert_close(logits[-1], eager.last_logits([ids])[0])
    finally:
        runners.close()
