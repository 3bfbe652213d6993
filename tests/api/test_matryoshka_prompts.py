"""vLLM's Matryoshka gate on `dimensions` (config.json) and the checkpoint's default_prompt_name
(as SentenceTransformer.encode applies it) on /v1/embeddings, /pooling and /embed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.model.pooling import from_checkpoint
from tests.api.test_embeddings import embedder

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
TEXTS = ["What is the capital of China?", "Explain gravity"]
DIMS = [16, 32, 64]


def edit(path: Path, **updates) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **updates}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Qwen3-Embedding-style, with matryoshka_dimensions and default_prompt_name "query" added."""
    path = tmp_path_factory.mktemp("mrl") / "qwen3_embedding"
    shutil.copytree(DATA / "qwen3_embedding", path)
    edit(path / "config.json", matryoshka_dimensions=DIMS)
    edit(path / "config_sentence_transformers.json", default_prompt_name="query")
    with embedder(str(path), 128) as served:
        yield served


def post(app, path: str, **body):
    r = app.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def same(got, want) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4, got - want


def test_published_configs_declare_no_matryoshka(tmp_path) -> None:
    assert not from_checkpoint(DATA / "qwen3_embedding").matryoshka  # as Qwen3-Embedding ships
    shutil.copytree(DATA / "llama_mean_embedding", tmp_path / "m")
    edit(tmp_path / "m" / "config.json", is_matryoshka=True)
    got = from_checkpoint(tmp_path / "m")
    assert got.matryoshka and got.matryoshka_dims is None and got.mode == "mean"


def test_default_prompt_name_as_sentence_transformers(served) -> None:
    app, st = served
    want = st.encode(TEXTS)  # default_prompt_name "query" applies
    assert st.default_prompt_name == "query" and st.prompts["query"]
    same([d["embedding"] for d in post(app, "/v1/embeddings", input=TEXTS)["data"]], want)
    same([d["data"] for d in post(app, "/pooling", input=TEXTS)["data"]], want)
    same(post(app, "/embed", inputs=TEXTS), want)
    same(post(app, "/embed", inputs=TEXTS, prompt_name="document"),
         st.encode(TEXTS, prompt_name="document"))


def test_dimensions_only_where_the_model_declares_them(served) -> None:
    app, st = served
    want = st.encode(TEXTS, truncate_dim=32, normalize_embeddings=True)
    got = post(app, "/v1/embeddings", input=TEXTS, dimensions=32)["data"]
    same([d["embedding"] for d in got], want)
    same([d["data"] for d in post(app, "/pooling", input=TEXTS, dimensions=32)["data"]], want)
    for path in ("/v1/embeddings", "/pooling"):
        r = app.post(path, json={"input": "x", "dimensions": 24})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "dimensions" and "matryoshka_dimensions" in err["message"]


@pytest.mark.parametrize("matryoshka", [None, True])
def test_dimensions_refused_without_matryoshka_unless_the_setting_says(matryoshka) -> None:
    """Qwen3-Embedding declares nothing: MATRYOSHKA=true is vLLM's hf_overrides is_matryoshka."""
    path = str(DATA / "qwen3_embedding")
    env = {} if matryoshka is None else {"matryoshka": matryoshka}
    with embedder(path, 64, **env) as (app, st):
        for route in ("/v1/embeddings", "/pooling"):
            r = app.post(route, json={"input": TEXTS, "dimensions": 32})
            if matryoshka:
                want = st.encode(TEXTS, truncate_dim=32, normalize_embeddings=True)
                key = "embedding" if route == "/v1/embeddings" else "data"
                same([d[key] for d in r.json()["data"]], want)
                continue
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "dimensions" and "MATRYOSHKA=true" in err["message"]
        assert len(post(app, "/embed", inputs="x", dimensions=32)[0]) == 32  # TEI: no gate
