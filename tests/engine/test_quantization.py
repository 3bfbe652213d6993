"""QUANTIZATION=fp8: the engine quantizes the loaded projections (norms unfolded), reports it,
and serves close to the unquantized model (the GPU path: tests/model/test_fp8_gpu.py)."""

from __future__ import annotations

from service.engine.core import EngineCore
from service.model.fp8 import Fp8Linear
from tests.engine.helpers import engine_cfg, tiny_loaded


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
