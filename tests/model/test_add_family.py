"""A family defined here, outside service/, whose checkpoints name their projections their own
way: registered, loaded by the real loader and served by the real EngineCore on CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine.core import EngineCore
from service.model import families
from service.model.errors import UnsupportedArchitecture
from service.model.families.base import Family
from tests.engine.helpers import engine_cfg
from tests.model.checkpoints import write_checkpoint

LLAMOID = Family(
    name="llamoid",
    architectures=("LlamoidForCausalLM",),
    model_types=("llamoid",),
    describe="Llamoid (a test)",
    from_hf=lambda c: c.common("llamoid"),
    projections={"q": "self_attn.query", "k": "self_attn.key", "v": "self_attn.value",
                 "o": "self_attn.out", "gate": "mlp.w1", "up": "mlp.w3", "down": "mlp.w2"},
    presets={"llamoid-tiny": dict(vocab_size=384, hidden_size=64, intermediate_size=160,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)},
)
LLAMA_NAMES = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out",
               "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Llama checkpoint and the same weights saved as a Llamoid one."""
    llama = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)
    llamoid = tmp_path_factory.mktemp("llamoid")
    renamed = {}
    for name, t in load_file(llama / "model.safetensors").items():
        parts = name.split(".")
        renamed[".".join(LLAMA_NAMES.get(p, p) for p in parts)] = t
    assert not any("_proj" in n for n in renamed)
    save_file(renamed, llamoid / "model.safetensors")
    raw = json.loads((llama / "config.json").read_text())
    raw.update(architectures=["LlamoidForCausalLM"], model_type="llamoid")
    (llamoid / "config.json").write_text(json.dumps(raw))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / f, llamoid / f)
    return llama, llamoid


@pytest.fixture
def registered():
    families.register(LLAMOID)
    yield LLAMOID
    families.unregister(LLAMOID.name)


def test_an_unregistered_family_is_refused(checkpoints):
    with pytest.raises(UnsupportedArchitecture, match="LlamoidForCausalLM"):
        EngineCore(engine_cfg(model_path=str(checkpoints[1])))


def test_a_family_from_outside_service_is_loaded_and_served(checkpoints, registered):
    prompt = list(range(5, 60))
    cores = [EngineCore(engine_cfg(model_path=str(p))) for p in checkpoints]
    try:
        assert [c.model_cfg.arch for c in cores] == ["llama", "llamoid"]
        want, got = (c.prefill_chunked(prompt) for c in cores)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        for c in cores:
            c.close()


def test_its_presets_come_and_go_with_it(registered):
    assert families.PRESETS["llamoid-tiny"]["arch"] == "llamoid"
    assert families.preset("llamoid-tiny").arch == "llamoid"
    families.unregister(registered.name)
    assert "llamoid-tiny" not in families.PRESETS and "llamoid" not in families.FAMILIES
