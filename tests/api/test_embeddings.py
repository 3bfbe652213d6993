"""POST /v1/embeddings on embedding checkpoints saved as published (tests/model/data): the vectors
sentence-transformers computes, through httpx and through the openai client."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.engine.core import EngineCore
from service.model.files import model_tokenizer
from tests.api.conftest import start_app

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
TEXTS = ["What is the capital of China?", "Explain gravity",
         "Gravity is a force that attracts two bodies towards each other. " * 2]
LIMIT = 256  # MAX_PROMPT_TOKENS; MAX_PREFILL_TOKENS=16 prefills the long text in chunks


@contextlib.contextmanager
def embedder(path: str, limit: int = LIMIT, **env):
    """(app, the SentenceTransformer) of the checkpoint at `path`, served on the CPU in fp32."""
    from sentence_transformers import SentenceTransformer

    app = start_app(EngineCore, model_tokenizer(path), model_path=path, device="cpu",
                    dtype="float32", page_size=4, max_prefill_tokens=16, max_prompt_tokens=limit,
                    **env)
    try:
        app.wait_ready()
        yield app, SentenceTransformer(path, device="cpu")
        assert app.scheduler.kv_used_tokens == 0, "an embedding kept its KV pages"
    finally:
        app.close()


@pytest.fixture(scope="module", params=["qwen3_embedding", "llama_mean_embedding"])
def served(request):
    with embedder(str(DATA / request.param)) as s:
        yield s


def embed(app, **body) -> dict:
    r = app.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def same(got, want) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999 and np.abs(got - want).max() <= 1e-4, (cos, got - want)


def test_matches_sentence_transformers(served) -> None:
    app, st = served
    prompt = st.prompts.get("query", "")
    out = embed(app, input=[prompt + t for t in TEXTS], model=app.state.model_name)
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and out["object"] == "list"
    same([d["embedding"] for d in out["data"]],
         st.encode(TEXTS, prompt_name="query" if prompt else None))
    assert out["usage"]["prompt_tokens"] == sum(
        len(st.tokenizer(prompt + t)["input_ids"]) for t in TEXTS)
    one = embed(app, input=TEXTS[1])  # a string, and token ids, are one input each
    ids = st.tokenizer(TEXTS[1])["input_ids"]
    same(embed(app, input=ids)["data"][0]["embedding"], one["data"][0]["embedding"])
    same(embed(app, input=[ids, ids])["data"][1]["embedding"], one["data"][0]["embedding"])


def test_dimensions_need_a_matryoshka_model(served) -> None:
    app, _ = served  # neither config declares it; test_matryoshka_prompts has one that does
    r = app.post("/v1/embeddings", json={"input": "x", "dimensions": 32})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_openai_client_float_and_base64(served) -> None:
    import openai

    app, st = served
    want = st.encode(TEXTS)

    async def both() -> tuple:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app.app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        f = await client.embeddings.create(model=app.state.model_name, input=TEXTS,
                                           encoding_format="float")
        b = await client.embeddings.create(model=app.state.model_name, input=TEXTS,
                                           encoding_format="base64")
        await http.aclose()
        return f, b

    f, b = app.run(both())
    same([d.embedding for d in f.data], want)
    assert all(isinstance(d.embedding, str) for d in b.data)  # the client hands base64 back raw
    same([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b.data], want)


def test_bad_inputs_are_400(served) -> None:
    app, _ = served
    long = "the quick brown fox jumps over the lazy dog " * 40
    for body, param in (({"input": long}, "input"), ({"input": []}, "input"),
                        ({"input": ""}, "input"), ({"input": [[]]}, "input[0]")):
        r = app.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    cut = embed(app, input=long, truncate_prompt_tokens=LIMIT)
    assert cut["usage"]["prompt_tokens"] == LIMIT


def test_head_less_checkpoint_refuses_generation(served) -> None:
    app, _ = served
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/prefill", {"prompt": "hi"})):
        r = app.post(path, json=body)
        assert r.status_code == 400 and "no LM head" in r.json()["error"]["message"], r.text


def test_embed_metrics(served) -> None:
    app, _ = served
    before = app.state.metrics.task["items"]["embed"]._value.get()
    embed(app, input=TEXTS[:2])
    assert app.state.metrics.task["items"]["embed"]._value.get() == before + 2


def test_non_pooling_model_names_pooling(api) -> None:
    r = api.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "POOLING" in r.json()["error"]["message"], r.text
