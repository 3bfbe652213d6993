"""POST /v1/score (SGLang's shape): label-token scores of query + item, the query prefilled once."""

from __future__ import annotations

import math

import pytest
import torch

from tests.api.conftest import metric

QUERY = ("<|im_start|>user\nIs the following city the capital of France? Answer Yes or No."
         "\nCity:")
ITEMS = [" Paris<|im_end|>\n<|im_start|>assistant\n", " London<|im_end|>\n<|im_start|>assistant\n",
         " Berlin<|im_end|>\n<|im_start|>assistant\n", " Lyon<|im_end|>\n<|im_start|>assistant\n"]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)


def score(api, **body):
    r = api.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def labels(core) -> list[int]:
    return [core.tokenizer.encode(w)[0] for w in ("Yes", "No", " Yes", " No")]


def test_scores_match_transformers(api, core, smollm2_hf) -> None:
    """Each item's scores are the label tokens' probabilities after query + item, equal to
    transformers' on the same prompt; with apply_softmax, normalised over the labels."""
    lab = labels(core)
    out = score(api, query=QUERY, items=ITEMS, label_token_ids=lab)
    assert out["object"] == "scoring" and out["model"] == "SmolLM2-135M-Instruct.Q4_1"
    soft = score(api, query=QUERY, items=ITEMS, label_token_ids=lab, apply_softmax=True)
    assert len(out["scores"]) == len(ITEMS)
    prompts = [core.tokenizer.encode(QUERY + it) for it in ITEMS]
    for ids, probs, norm in zip(prompts, out["scores"], soft["scores"]):
        ref = hf_logprobs(smollm2_hf, ids)[lab]
        assert probs == pytest.approx(ref.exp().tolist(), abs=2e-3, rel=2e-2)
        assert norm == pytest.approx(torch.softmax(ref, -1).tolist(), abs=2e-3)
        assert sum(norm) == pytest.approx(1.0)
    total = sum(map(len, prompts))
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == total
    assert usage["completion_tokens"] == 0


def test_the_query_is_prefilled_apart_once_that_saves_enough(make_app, core) -> None:
    """A query shared by the items is prefilled once when that saves MIN_SAVED_TOKENS
    (shared x (items - 1)); below, the prompts run whole. Either way the scores agree."""
    from service.api.native.score import MIN_SAVED_TOKENS

    app = make_app(prefix_cache="false")
    n = MIN_SAVED_TOKENS // 2 + 8  # two items save less than the bar, three more
    query = (core.tokenizer.encode(QUERY) * (n // 8))[:n]
    lab = labels(core)
    two = score(app, query=query, items=[[11], [12]], label_token_ids=lab)
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    forwards = len(app.engine.forwards)
    three = score(app, query=query, items=[[11], [12], [13]], label_token_ids=lab)
    # the query's tokens are prefilled once and count as cached for every item
    assert three["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * n
    held = [len(c) for f in app.engine.forwards[forwards:] for c in f]
    assert sum(held) == n + 3
    for a, b in zip(three["scores"][:2], two["scores"], strict=True):
        assert [math.log(x) for x in a] == pytest.approx([math.log(x) for x in b], abs=1e-4)


def test_shared_query_scores_equal_single_prompts(make_app, core) -> None:
    """Against the engine's own single-request path (/v1/prefill with logprob_token_ids), with
    the prefix cache off, a query of several pages and one the forward budget splits, and
    items split across forwards: token ids in, every score within 1e-4 in logprob."""
    app = make_app(prefix_cache="false", max_batch_prompts=3, max_batch_tokens=64)
    query = core.tokenizer.encode(QUERY * 8)[:150]
    items = [core.tokenizer.encode(w)[:k] for w, k in
             ((" Paris is lovely", 3), (" no", 1), (" London, sadly", 4), (" Lyon", 2),
              (" Nice", 1), (" Marseille or Rome", 5), (" Tours", 2))]
    lab = labels(core)
    out = score(app, query=query, items=items, label_token_ids=lab)
    before = len(app.engine.forwards)
    for it, got in zip(items, out["scores"]):
        solo = app.post("/v1/prefill", json={"input_ids": query + it,
                                              "logprob_token_ids": lab}).json()
        want = [t["logprob"] for t in solo["results"][0]["token_logprobs"]]
        assert [math.log(p) for p in got] == pytest.approx(want, abs=1e-4)
    assert len(app.engine.forwards) > before
    # the grouped request computed the query once: its forwards held query + items' tokens
    forwards = app.engine.forwards[:before]
    assert sum(len(c) for f in forwards for c in f) == len(query) + sum(map(len, items))


def test_item_first_and_whole_prompt_items(api, core) -> None:
    lab = labels(core)
    first = score(api, query=" is the capital of France.", items=["Paris", "Rome"],
                  label_token_ids=lab, item_first=True)
    whole = score(api, query="", items=["Paris is the capital of France.",
                                        "Rome is the capital of France."],
                  label_token_ids=lab)
    for a, b in zip(first["scores"], whole["scores"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    single = score(api, query=QUERY, items=ITEMS[0], label_token_ids=lab)  # one text item
    assert len(single["scores"]) == 1


def test_score_metrics(make_app, core) -> None:
    app = make_app()
    query = core.tokenizer.encode(QUERY * 16)  # long enough that sharing it pays
    score(app, query=query, items=[[11], [12, 13], [14]], label_token_ids=labels(core))
    text = app.get("/metrics").text
    assert metric(text, "prefill_score_queries_total") == 1
    assert metric(text, "prefill_score_items_total") == 3
    assert metric(text, "prefill_score_shared_tokens_total") == 2 * len(query)


def test_the_route_is_in_the_openapi_schema(api) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert "/v1/score" in paths and "/v1/models" in paths


@pytest.mark.parametrize("body, field, says", [
    ({"items": ["a"], "label_token_ids": [1]}, "query", "required"),
    ({"query": "q", "label_token_ids": [1]}, "items", "required"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items", "required"),
    ({"query": "q", "items": ["a"]}, "label_token_ids", "required"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids", "required"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 49152]}, "label_token_ids[1]",
     "not a token id"),
    ({"query": "q", "items": ["a"], "label_token_ids": list(range(257))}, "label_token_ids",
     "at most 256"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items", "must be texts"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "items", "token-id lists"),
    ({"query": [1], "items": [[2], [49152]], "label_token_ids": [1]}, "items[1][0]",
     "not a token id"),
    ({"query": [1], "items": [[2]] * 257, "label_token_ids": [1]}, "items", "at most 256"),
    ({"query": [1] * 9000, "items": [[2]], "label_token_ids": [1]}, "query", "limit"),
    ({"query": [1] * 5000, "items": [[2] * 4000], "label_token_ids": [1]}, "items[0]", "limit"),
    ({"query": "", "items": [""], "label_token_ids": [1]}, "items[0]", "empty"),
    ({"query": [], "items": [[5], []], "label_token_ids": [1]}, "items[1]", "empty"),
    ({"query": [1, -3], "items": [[5]], "label_token_ids": [1]}, "query[1]", "not a token id"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "model": "gpt-9"}, "model",
     "does not exist"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "guided_choice": ["a"]},
     "guided_choice", "not supported"),
])
def test_bad_score_requests_are_a_400_naming_the_field(api, body, field, says) -> None:
    r = api.post("/v1/score", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == field and says in err["message"], err


def test_an_sglang_style_client_over_a_real_server(served, core) -> None:
    """SGLang's documented call (a plain JSON POST to /v1/score) against uvicorn as the CLI runs
    it: the same scores as through the app."""
    import httpx

    url = served()
    body = {"query": QUERY, "items": ITEMS[:2], "label_token_ids": labels(core),
            "apply_softmax": True, "model": "SmolLM2-135M-Instruct.Q4_1"}
    r = httpx.post(url + "/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and len(out["scores"]) == 2
    again = score(served.live, **body)  # the second time, the query's pages come from the cache
    for a, b in zip(out["scores"], again["scores"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)
