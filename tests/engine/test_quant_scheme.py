"""A quantization scheme defined here, outside service/: registered in service.model.quant,
chosen by QUANTIZATION, served by the real EngineCore and the graph runners' buffers, and
reported by the engine's info."""

from __future__ import annotations

import copy

import pytest
import torch

from service.config import load_settings
from service.engine.core import EngineCore
from service.model import quant
from service.model.quant import Scheme, replace_projections
from service.model.quant.plain import Linear
from tests.engine.helpers import Runners, engine_cfg, tiny_loaded
from tests.model.prefill import Prefiller


class RoundedLinear(Linear):
    """Weights rounded to bf16, held in the model's dtype; a norm weight would undo that."""

    foldable = False

    @classmethod
    def of(cls, p: Linear) -> RoundedLinear:
        r = cls(p.in_features, p.out_features, bias=p.bias is not None,
                dtype=p.weight.dtype, device=p.weight.device)
        r.load_state_dict(p.state_dict())
        r.weight.data = r.weight.data.bfloat16().to(p.weight.dtype)
        return r


class RoundToBf16(Scheme):
    name = "bf16-round"
    label = "weights rounded to bf16"

    def convert(self, model: torch.nn.Module) -> None:
        replace_projections(model, RoundedLinear.of)
        model.scheme = self

    def scratch(self, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(rows, cols, dtype=torch.bfloat16, device=device)


@pytest.fixture
def scheme():
    s = RoundToBf16()
    quant.register(s, setting="weights rounded to bf16 (a test)")
    yield s
    quant.unregister(s.name)


def test_the_setting_takes_its_values_from_the_registry(scheme):
    assert quant.settings() == ("none", "fp8", "bf16-round")
    assert load_settings({"QUANTIZATION": "bf16-round"}).quantization == "bf16-round"
    quant.unregister(scheme.name)
    with pytest.raises(Exception, match="QUANTIZATION='bf16-round': must be one of none, fp8"):
        load_settings({"QUANTIZATION": "bf16-round"})


def test_a_scheme_from_outside_service_is_served_and_reported(scheme):
    prompt = list(range(3, 40))
    rounded = copy.deepcopy(tiny_loaded(seed=4).model)
    replace_projections(rounded, RoundedLinear.of)  # the same weights, plain and unfolded
    want = Prefiller(rounded).last_logits([prompt])[0]
    plain = EngineCore(engine_cfg(), loaded=tiny_loaded(seed=4))
    ours = EngineCore(engine_cfg(quantization="bf16-round"), loaded=tiny_loaded(seed=4))
    try:
        assert ours.info().quantization == "weights rounded to bf16"
        assert plain.model.norms_folded and not ours.model.norms_folded
        got, unrounded = ours.prefill_chunked(prompt), plain.prefill_chunked(prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert (got - unrounded).abs().max() > 2e-5  # bf16 weights: 2^-9 relative error
    finally:
        plain.close()
        ours.close()


def test_the_graph_runners_allocate_the_scratch_it_declares(scheme):
    model = tiny_loaded(seed=2).model
    scheme.convert(model)
    runners = Runners(model, buckets=[8, 32])
    try:
        bufs, c = runners.breakable.bufs, model.cfg
        assert bufs.qin.shape == (32, max(c.hidden_size, c.q_size))
        assert bufs.qin_mlp.shape == (bufs.mlp_rows, c.intermediate_size)
        ids = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
        eager = Prefiller(model)
        logits, _, mode = runners.prefill([eager.chunk(ids.tolist())], eager.pool.cache)
        assert mode == "graph"
        torch.testing.assert_close(logits[-1], eager.last_logits([ids.tolist()])[0])
    finally:
        runners.close()
