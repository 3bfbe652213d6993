"""QUANTIZATION=fp8: the engine quantizes after the norm fold, reports it, and serves close to
the unquantized model; a GPU engine refuses FP8 until its kernels exist."""

from __future__ import annotations

import pytest

from service.engine.core import EngineCore
from service.model.errors import ModelLoadError
from service.model.fp8 import Fp8Linear
from tests.engine.helpers import engine_cfg, tiny_loaded


def test_fp8_engine_quantizes_folded_weights_and_says_so():
    prompt = list(range(3, 40))
    plain = EngineCore(engine_cfg(), loaded=tiny_loaded(seed=4))
    fp8 = EngineCore(engine_cfg(quantization="fp8"), loaded=tiny_loaded(seed=4))
    try:
        assert plain.info().quantization == "none"
        assert fp8.info().quantization == ("fp8 e4m3, weights per channel, activations per "
                                           "token")
        layer = fp8.model.layers[0]
        assert fp8.model.norms_folded and isinstance(layer.qkv_proj, Fp8Linear)
        assert isinstance(layer.mlp.gate_up_proj, Fp8Linear)
        want, got = plain.prefill_chunked(prompt), fp8.prefill_chunked(prompt)
        assert 0 < ((got - want).norm() / want.norm()).item() < 0.05
    finally:
        plain.close()
        fp8.close()


def test_a_gpu_engine_refuses_fp8(monkeypatch):
    """The check runs before any CUDA work: a CUDA device name is enough to reach it."""
    import service.engine.core as core

    monkeypatch.setattr(core.torch.cuda, "Stream", lambda *a, **k: pytest.fail("got past it"))
    cfg = engine_cfg(quantization="fp8", device="cuda")
    with pytest.raises(ModelLoadError, match="CPU reference path only") as e:
        EngineCore(cfg, loaded=tiny_loaded(), memory_reader=lambda: 1 << 40)
    assert "\n" not in str(e.value)
