"""Embedding checkpoints load as published: the bare decoder's un-prefixed tensors, no lm_head."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.model.errors import ModelLoadError
from service.model.loader import load_model
from service.model.pooling import Pooling, from_checkpoint, resolve

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name", ["qwen3_embedding", "llama_mean_embedding"])
def test_un_prefixed_head_less_checkpoint_loads(name: str) -> None:
    loaded = load_model(DATA / name)
    assert not loaded.lm_head  # the API refuses it generation
    assert loaded.cfg.tie_word_embeddings  # the forward runs its embedding as head


def test_pooling_as_sentence_transformers_reads_it() -> None:
    q = from_checkpoint(DATA / "qwen3_embedding")
    assert (q.mode, q.normalize) == ("last", True) and q.prompts["query"].startswith("Instruct:")
    assert from_checkpoint(DATA / "llama_mean_embedding").mode == "mean"
    assert resolve(DATA / "qwen3_embedding", "cls", False) == Pooling(
        "cls", False, q.prompts, None)
    assert resolve(DATA / "qwen3_embedding", "none", None).mode == ""


def test_unserved_pooling_mode_names_pooling(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        '[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ModelLoadError, match="POOLING"):
        from_checkpoint(tmp_path)
