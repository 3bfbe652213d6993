"""vLLM's POST /pooling and /classify, TEI's POST /predict on a 3-label Llama classifier saved as
published (tests/model/data/llama_seq_cls): transformers' logits within 1e-4."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.api.test_classify import classifier

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
TEXTS = ["What a great day", "Explain gravity",
         "Gravity is a force that attracts two bodies towards each other. " * 2]
LIMIT = 128


@pytest.fixture(scope="module")
def served():
    with classifier("llama_seq_cls", LIMIT) as s:
        yield s


def logits(tok, ref, *texts: str) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([tok(*texts)["input_ids"]])).logits[0].numpy()


def post(app, path: str, **body):
    r = app.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_classify_matches_transformers(served) -> None:
    app, tok, ref = served
    want = np.stack([logits(tok, ref, t) for t in TEXTS])
    got = post(app, "/classify", input=TEXTS, use_activation=False)["data"]
    assert np.abs(np.array([d["probs"] for d in got]) - want).max() <= 1e-4
    assert [d["label"] for d in got] == [ref.config.id2label[int(w.argmax())] for w in want]
    probs = post(app, "/classify", input=TEXTS)["data"]
    soft = torch.from_numpy(want).softmax(-1).numpy()
    assert np.abs(np.array([d["probs"] for d in probs]) - soft).max() <= 1e-4


def test_pooling_on_a_classifier_gives_the_head_scores(served) -> None:
    app, tok, ref = served
    want = np.stack([logits(tok, ref, t) for t in TEXTS])
    out = post(app, "/pooling", input=TEXTS, use_activation=False)
    assert out["object"] == "list" and out["id"].startswith("pool-")
    assert [(d["index"], d["object"]) for d in out["data"]] == [(i, "pooling") for i in range(3)]
    assert np.abs(np.array([d["data"] for d in out["data"]]) - want).max() <= 1e-4
    assert out["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    b64 = post(app, "/pooling", input=TEXTS[0], task="classify", encoding_format="base64")
    soft = torch.from_numpy(want[0]).softmax(-1).numpy()
    got = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), "<f4")
    assert np.abs(got - soft).max() <= 1e-4
    for body, field in (({"input": "x", "task": "embed"}, "model"),
                        ({"input": "x", "task": "token_embed"}, "task"),
                        ({"input": "x", "dimensions": 2}, "dimensions"),
                        ({"input": []}, "input")):
        r = app.post("/pooling", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def ranked(row: np.ndarray, labels: dict) -> list[tuple[str, float]]:
    return sorted(((labels[j], float(s)) for j, s in enumerate(row)), key=lambda x: -x[1])


def same(got: list[dict], want: list[tuple[str, float]]) -> None:
    assert [d["label"] for d in got] == [w[0] for w in want], (got, want)
    assert max(abs(d["score"] - w[1]) for d, w in zip(got, want)) <= 1e-4


def test_predict_shapes_as_tei(served) -> None:
    app, tok, ref = served
    labels = ref.config.id2label
    soft = torch.from_numpy(logits(tok, ref, TEXTS[0])).softmax(-1).numpy()
    same(post(app, "/predict", inputs=TEXTS[0]), ranked(soft, labels))
    pair = logits(tok, ref, TEXTS[0], TEXTS[1])  # two strings are one pair, as in TEI
    same(post(app, "/predict", inputs=TEXTS[:2], raw_scores=True), ranked(pair, labels))
    batch = post(app, "/predict", inputs=[TEXTS[1], [TEXTS[0], TEXTS[1]], [TEXTS[2]]],
                 raw_scores=True)
    assert len(batch) == 3
    for got, want in zip(batch, [logits(tok, ref, TEXTS[1]), pair, logits(tok, ref, TEXTS[2])]):
        same(got, ranked(want, labels))
    long = "gravity " * 200
    r = app.post("/predict", json={"inputs": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs[0]", r.text
    cut = post(app, "/predict", inputs=long, truncate=True, raw_scores=True)
    ids = tok(long, truncation=True, max_length=LIMIT)["input_ids"]  # specials kept
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    same(cut, ranked(want, labels))
    for body in ({"inputs": []}, {"inputs": [["a", "b", "c"]]}):
        r = app.post("/predict", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "inputs", r.text


@pytest.mark.parametrize("problem_type, act", [
    ("multi_label_classification", torch.sigmoid), ("regression", lambda x: x)])
def test_config_problem_type_picks_the_activation_as_vllm(tmp_path, problem_type, act) -> None:
    """transformers' loss for the type: sigmoid per label (multi-label), none (regression)."""
    import json
    import shutil

    path = tmp_path / "llama_seq_cls"
    shutil.copytree(DATA / "llama_seq_cls", path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "problem_type": problem_type}))
    with classifier(str(path), LIMIT) as (app, tok, ref):
        want = act(torch.from_numpy(np.stack([logits(tok, ref, t) for t in TEXTS]))).numpy()
        for route, key in (("/classify", "probs"), ("/pooling", "data")):
            got = np.array([d[key] for d in post(app, route, input=TEXTS)["data"]])
            assert np.abs(got - want).max() <= 1e-4, route
        top = post(app, "/predict", inputs=TEXTS[0])
        assert top[0]["score"] == pytest.approx(float(want[0].max()), abs=1e-4)
