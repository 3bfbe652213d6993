"""TEI's POST /embed (and POST /) on the committed Qwen3-Embedding checkpoint: sentence-
transformers' vectors, over httpx and through huggingface_hub's InferenceClient."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import numpy as np
import pytest

from tests.api.conftest import wait_for
from tests.api.test_embeddings import TEXTS, embedder, same

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
LIMIT = 256


@pytest.fixture(scope="module")
def served():
    with embedder(str(DATA / "qwen3_embedding"), LIMIT) as s:
        yield s


def embed(app, **body) -> list:
    r = app.post("/embed", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_embed_matches_sentence_transformers(served) -> None:
    app, st = served
    same(embed(app, inputs=TEXTS, prompt_name="query"), st.encode(TEXTS, prompt_name="query"))
    one = embed(app, inputs=TEXTS[0])  # one string: still one row
    assert len(one) == 1
    same(one, st.encode(TEXTS[:1]))
    same(embed(app, inputs=TEXTS, dimensions=16),
         st.encode(TEXTS, truncate_dim=16, normalize_embeddings=True))
    raw = np.asarray(embed(app, inputs=TEXTS, normalize=False))
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).max() > 1e-3
    same(raw / np.linalg.norm(raw, axis=1, keepdims=True), st.encode(TEXTS))
    assert app.post("/", json={"inputs": TEXTS}).json() == embed(app, inputs=TEXTS)


def test_embed_truncation(served) -> None:
    app, st = served
    long = "the quick brown fox jumps over the lazy dog " * 40
    r = app.post("/embed", json={"inputs": [TEXTS[0], long]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs[1]", r.text
    ids = st.tokenizer(long, add_special_tokens=False)["input_ids"]
    right, left = ids[:LIMIT - 1], ids[-(LIMIT - 1):]  # room for the trailing <|endoftext|>
    for direction, kept in (("Right", right), ("left", left)):
        got = embed(app, inputs=long, truncate=True, truncation_direction=direction)
        same(got, st.encode([st.tokenizer.decode(kept)]))


def test_embed_bad_inputs_are_400(served) -> None:
    app, _ = served
    for body, param in (({"inputs": "x", "prompt_name": "nope"}, "prompt_name"),
                        ({"inputs": []}, "inputs"), ({"inputs": ""}, "inputs"),
                        ({"inputs": "x", "dimensions": 100000}, "dimensions"),
                        ({"inputs": "x", "truncation_direction": "Up"}, "truncation_direction")):
        r = app.post("/embed", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_inference_client_feature_extraction(served, monkeypatch) -> None:
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    app, st = served
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # loopback only
    with serving(app) as url:
        client = InferenceClient(base_url=url)
        same(client.feature_extraction(TEXTS[1]), st.encode(TEXTS[1:2]))
        got = client.feature_extraction(TEXTS[0], prompt_name="query", dimensions=16)
        same(got, st.encode(TEXTS[:1], prompt_name="query", truncate_dim=16,
                             normalize_embeddings=True))


@contextlib.contextmanager
def serving(app):
    """The app on a loopback port, served by uvicorn on the app's own loop."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app.app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    done = app.submit(server.serve())
    try:
        wait_for(lambda: server.started, 10, "uvicorn")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        done.result(10)
