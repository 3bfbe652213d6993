"""POST /classify on sequence classifiers saved as published (tests/model/data): the logits
transformers' AutoModelForSequenceClassification computes, through the engine's score head."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import ConfigError, load_settings
from service.engine.core import EngineCore
from service.model.files import model_tokenizer
from tests.api.conftest import start_app

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
TEXTS = ["What a great day", "Explain gravity", "ends with pad<|endoftext|><|endoftext|>",
         "Gravity is a force that attracts two bodies towards each other. " * 2]


@contextlib.contextmanager
def classifier(name: str, limit: int = 256):
    """(app, tokenizer, transformers' model) of the committed checkpoint `name`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(DATA / name)
    app = start_app(EngineCore, model_tokenizer(path), model_path=path, device="cpu",
                    dtype="float32", page_size=4, max_prefill_tokens=16, max_prompt_tokens=limit)
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForSequenceClassification.from_pretrained(path).eval()
    try:
        app.wait_ready()
        yield app, tok, ref
        assert app.scheduler.kv_used_tokens == 0, "a classification kept its KV pages"
    finally:
        app.close()


@pytest.fixture(scope="module", params=["qwen3_seq_cls", "llama_reward"])
def served(request):
    with classifier(request.param) as s:
        yield s


def reference(tok, ref, text: str) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([tok(text)["input_ids"]])).logits[0].numpy()


def test_matches_transformers(served) -> None:
    app, tok, ref = served
    r = app.post("/classify", json={"input": TEXTS, "use_activation": False})
    assert r.status_code == 200, r.text
    out = r.json()
    want = np.stack([reference(tok, ref, t) for t in TEXTS])
    got = np.array([d["probs"] for d in out["data"]])
    assert np.abs(got - want).max() <= 1e-4, (got, want)
    labels = ref.config.id2label
    assert [d["label"] for d in out["data"]] == [labels[int(w.argmax())] for w in want]
    assert [d["num_classes"] for d in out["data"]] == [want.shape[1]] * len(TEXTS)
    ids = [tok(t)["input_ids"] for t in TEXTS]  # trailing pad ids do not run
    run = [max(j for j, t in enumerate(i) if t != tok.pad_token_id) + 1 for i in ids]
    assert out["object"] == "list" and out["usage"]["prompt_tokens"] == sum(run)


def test_activation(served) -> None:
    app, tok, ref = served
    r = app.post("/classify", json={"input": TEXTS[0]})
    assert r.status_code == 200, r.text
    want = torch.from_numpy(reference(tok, ref, TEXTS[0]))
    want = want.sigmoid() if want.numel() == 1 else want.softmax(-1)
    assert np.abs(np.array(r.json()["data"][0]["probs"]) - want.numpy()).max() <= 1e-4
    assert app.post("/classify", json={"input": []}).status_code == 400
    assert app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}
                    ).status_code == 400, "a classifier has no LM head"


def test_model_without_head_is_400() -> None:
    path = str(DATA / "qwen3_embedding")
    app = start_app(EngineCore, model_tokenizer(path), model_path=path, device="cpu",
                    dtype="float32", page_size=4, max_prompt_tokens=64)
    try:
        app.wait_ready()
        r = app.post("/classify", json={"input": "hi"})
        assert r.status_code == 400 and "SCORE_HEAD" in r.text, r.text
    finally:
        app.close()


def test_score_head_setting_is_checked_at_start_up() -> None:
    assert load_settings({"SCORE_HEAD": "Yes-No"}).score_head == "yes-no"
    with pytest.raises(ConfigError, match="SCORE_HEAD"):
        load_settings({"SCORE_HEAD": "maybe"})
