"""Rerank (/v1/rerank, /rerank, Cohere's /v2/rerank) against transformers: Qwen3-Reranker's
P(yes) as its model card computes it (SCORE_HEAD=yes-no), and a 1-label cross-encoder's pair."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from service.api.retrieval.rerank import QWEN3_PREFIX, QWEN3_SUFFIX, QWEN3_TASK
from service.engine.core import EngineCore
from service.model.files import model_tokenizer
from tests.api.conftest import start_app

DATA = Path(__file__).resolve().parents[1] / "model" / "data"
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity attracts two bodies.", "Paris is in France"]


def serve(name: str, **env):
    path = str(DATA / name)
    return start_app(EngineCore, model_tokenizer(path), model_path=path, device="cpu",
                     dtype="float32", page_size=4, max_prefill_tokens=64, max_prompt_tokens=512,
                     **env)


@pytest.fixture(scope="module")
def reranker():
    app = serve("qwen3_reranker", score_head="yes-no")
    try:
        app.wait_ready()
        yield app
        assert app.scheduler.kv_used_tokens == 0, "a rerank kept its KV pages"
    finally:
        app.close()


def p_yes(docs: list[str], query: str = QUERY) -> np.ndarray:
    """The model card's score: softmax over the [no, yes] logits at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = DATA / "qwen3_reranker"
    tok, lm = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for d in docs:
        body = f"<Instruct>: {QWEN3_TASK}\n<Query>: {query}\n<Document>: {d}"
        ids = [tok.encode(s, add_special_tokens=False) for s in (QWEN3_PREFIX, body, QWEN3_SUFFIX)]
        with torch.no_grad():
            logits = lm(torch.tensor([sum(ids, [])])).logits[0, -1]
        out.append(logits[[no, yes]].softmax(-1)[1].item())
    return np.array(out)


def test_jina_shape_matches_p_yes(reranker) -> None:
    want = p_yes(DOCS)
    r = reranker.post("/v1/rerank", json={"query": QUERY, "documents": [
        DOCS[0], {"text": DOCS[1]}, DOCS[2]]})
    assert r.status_code == 200, r.text
    out = r.json()
    order = list(np.argsort(-want))
    assert [x["index"] for x in out["results"]] == order
    got = np.array([x["relevance_score"] for x in out["results"]])
    assert np.abs(got - want[order]).max() <= 1e-5, (got, want)
    assert [x["document"]["text"] for x in out["results"]] == [DOCS[i] for i in order]
    assert out["usage"]["prompt_tokens"] > 0
    r = reranker.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 1,
                                       "return_documents": False})
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [{"index": order[0], "relevance_score": out["results"][0][
        "relevance_score"]}]


def test_cohere_client_v2(reranker) -> None:
    import cohere

    async def call():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(reranker.app), base_url="http://t")
        client = cohere.AsyncClientV2(api_key="x", base_url="http://t", httpx_client=http)
        return await client.rerank(model=reranker.state.model_name, query=QUERY,
                                   documents=DOCS, top_n=2, max_tokens_per_doc=4)

    res = reranker.run(call())
    cut = p_yes([reranker.state.tokenizer.decode(
        reranker.state.tokenizer.encode(d, add_special=False)[:4]) for d in DOCS])
    order = list(np.argsort(-cut))[:2]
    assert [x.index for x in res.results] == order
    assert np.abs(np.array([x.relevance_score for x in res.results]) - cut[order]).max() <= 1e-5
    assert res.meta.api_version.version == "2"


def test_tei_shape(reranker) -> None:
    want = p_yes(DOCS)
    r = reranker.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert r.status_code == 200, r.text
    order = list(np.argsort(-want))
    assert [x["index"] for x in r.json()] == order
    assert [x["text"] for x in r.json()] == [DOCS[i] for i in order]
    assert np.abs(np.array([x["score"] for x in r.json()]) - want[order]).max() <= 1e-5
    raw = reranker.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
    logit = np.log(want / (1 - want))
    assert np.abs(np.array([x["score"] for x in raw.json()]) - logit[order]).max() <= 1e-4
    assert "text" not in raw.json()[0]
    both = reranker.post("/rerank", json={"query": QUERY, "texts": DOCS, "documents": DOCS})
    assert both.status_code == 400 and "texts" in both.text
    long = {"query": QUERY, "texts": ["x" * 3000], "truncate": True}
    assert reranker.post("/rerank", json=long).status_code == 200


def test_errors(reranker) -> None:
    for body in ({"query": QUERY, "documents": []}, {"query": QUERY},
                 {"query": QUERY, "documents": ["x" * 3000]}):
        r = reranker.post("/v1/rerank", json=body)
        assert r.status_code in (400, 422), r.text
    long = {"query": QUERY, "documents": ["x" * 3000], "truncate_prompt_tokens": 300}
    assert reranker.post("/v1/rerank", json=long).status_code == 200


def test_cross_encoder_pair() -> None:
    """A 1-label sequence classifier scores the tokenizer's (query, document) pair."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = DATA / "llama_reward"
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        want = torch.cat([ref(**tok(QUERY, d, return_tensors="pt")).logits[0] for d in DOCS])
    app = serve("llama_reward")
    try:
        app.wait_ready()
        r = app.post("/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                         "use_activation": False})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert np.abs(np.array([got[i] for i in range(3)]) - want.numpy()).max() <= 1e-4
    finally:
        app.close()


def test_vllm_score_shape(reranker) -> None:
    """vLLM's /score body on /score and /v1/score: one text_1 broadcast, or pairs; data in order."""
    want = p_yes(DOCS)
    for path in ("/score", "/v1/score"):
        r = reranker.post(path, json={"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2] and data[0]["object"] == "score"
        assert np.abs(np.array([d["score"] for d in data]) - want).max() <= 1e-5
    r = reranker.post("/score", json={"queries": [QUERY] * 2, "documents": DOCS[:2]})
    assert r.status_code == 200, r.text
    assert np.abs(np.array([d["score"] for d in r.json()["data"]]) - want[:2]).max() <= 1e-5
    for bad in ({"text_1": [QUERY] * 2, "text_2": DOCS}, {"text_1": QUERY},
                {"text_1": QUERY, "text_2": DOCS, "label_token_ids": [1]}):
        r = reranker.post("/v1/score", json=bad)
        assert r.status_code == 400, r.text


def test_task_metrics(reranker) -> None:
    items = reranker.state.metrics.task["items"]
    before = {t: items[t]._value.get() for t in ("rerank", "score")}
    assert reranker.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).status_code == 200
    assert reranker.post("/score", json={"text_1": QUERY, "text_2": DOCS[:2]}).status_code == 200
    assert items["rerank"]._value.get() == before["rerank"] + 3
    assert items["score"]._value.get() == before["score"] + 2
