"""/v1/embeddings' chat form (vLLM's EmbeddingChatRequest), and MTEB's OpenAI-API wrapper against
the service scoring as MTEB does on the SentenceTransformer itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from service.engine.core import EngineCore
from service.model.files import model_tokenizer
from tests.api.conftest import start_app
from tests.api.test_embeddings import TEXTS, same
from tests.api.test_tei import DATA, serving

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    path = tmp_path_factory.mktemp("ckpt") / "qwen3_embedding"
    shutil.copytree(DATA / "qwen3_embedding", path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    app = start_app(EngineCore, model_tokenizer(str(path)), model_path=str(path), device="cpu",
                    dtype="float32", page_size=4, max_prefill_tokens=16, max_prompt_tokens=256)
    try:
        app.wait_ready()
        yield app, SentenceTransformer(str(path), device="cpu")
    finally:
        app.close()


def vecs(app, **body) -> list:
    r = app.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def test_chat_form_renders_without_generation_prompt(served) -> None:
    app, st = served
    rendered = [f"<|im_start|>user\n{t}<|im_end|>\n" for t in TEXTS]
    want = st.encode(rendered)  # the template's text plus the post-processor's <|endoftext|>
    parts = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in TEXTS]
    same(vecs(app, messages=parts, add_special_tokens=True), want)
    plain = vecs(app, input=rendered, add_special_tokens=False)
    same(vecs(app, messages=[{"role": "user", "content": TEXTS[0]}]), plain[:1])
    for body, param in (({"messages": []}, "messages"), ({}, "input"),
                        ({"input": "x", "messages": parts[0]}, "input")):
        r = app.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_mteb_openai_wrapper_scores_as_sentence_transformers(served, tmp_path) -> None:
    mteb = pytest.importorskip("mteb")
    from mteb.cache import ResultCache
    from mteb.mocks.mock_tasks import MockRetrievalTask
    from mteb.models.openai_wrappers import OpenAIAPIEncodeWrapper

    app, st = served
    prompts = {"query": st.prompts["query"]}
    kw = dict(cache=ResultCache(str(tmp_path / "cache")), overwrite_strategy="always",
              show_progress_bar=False, co2_tracker=False)
    with serving(app) as url:
        api = OpenAIAPIEncodeWrapper(url, app.state.model_name, prompt_dict=prompts,
                                     modalities=["text"], use_chat_template=False)
        api.model_prompts = prompts  # mteb 2.26 resolves prompt names through model_prompts
        mteb.evaluate(api, MockRetrievalTask(), prediction_folder=tmp_path / "api", **kw)
    ref = mteb.models.SentenceTransformerEncoderWrapper(st, model_prompts=prompts)
    mteb.evaluate(ref, MockRetrievalTask(), prediction_folder=tmp_path / "st", **kw)
    got, want = (scores(tmp_path / d) for d in ("api", "st"))
    assert got.keys() == want.keys() and len(got) >= 4
    assert max(abs(got[k] - want[k]) for k in got) <= 1e-4, (got, want)


def scores(folder: Path) -> dict[str, float]:
    """Every query-document score in MTEB's prediction file, keyed by its path."""
    out: dict[str, float] = {}

    def walk(x, key: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}/{k}")
        elif isinstance(x, (int, float)):
            out[key] = float(x)

    walk(json.loads(next(folder.glob("*.json")).read_text()), "")
    return out
