"""Every way a checkpoint can be broken gives an error that says what is wrong and where."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from service.model.errors import ModelLoadError, UnsupportedArchitecture
from service.model.files import default_model_path
from service.model.loader import load_model
from tests.model.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("good"), "llama")


@pytest.fixture
def ckpt(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    (ckpt / "x.gguf").unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(ckpt)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights \(expected model\.safetensors"):
        load_model(ckpt)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        load_model(ckpt)


def test_missing_config_key(ckpt):
    _edit_config(ckpt, hidden_size=None)
    with pytest.raises(ModelLoadError, match=r"config\.json: missing required key 'hidden_size'"):
        load_model(ckpt)


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(UnsupportedArchitecture) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "MambaForCausalLM" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg


def test_shape_mismatch(ckpt):
    _edit_config(ckpt, intermediate_size=128)
    with pytest.raises(ModelLoadError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "gate_proj.weight" in msg and "(160, 64)" in msg and "(128, 64)" in msg


def test_missing_tensor(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj"):
        load_model(ckpt)


def test_missing_shard(tmp_path):
    path = write_checkpoint(tmp_path / "sharded", "qwen2", shards=3)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing: .*{shard.name}"):
        load_model(path)


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: missing tokenizer file"):
        load_model(ckpt)


def test_truncated_gguf(tmp_path):
    src = default_model_path()
    dst = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        dst.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: cannot read GGUF"):
        load_model(dst)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match=r"GGUF architecture 'gpt2'.*llama"):
        load_model(path)


def test_dtype_defaults():
    from service.model.loader import default_dtype

    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
