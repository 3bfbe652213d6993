"""POST /v1/prefill: inputs, first token, logprobs, sampling, batching, chunking."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import metric

FRANCE = "The capital of France is"


def prefill(api, **body):
    r = api.post("/v1/prefill", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_single_prompt_greedy(api) -> None:
    out = prefill(api, prompt=FRANCE, top_logprobs=5)
    assert out["object"] == "prefill" and out["model"] == "SmolLM2-135M-Instruct.Q4_1"
    (res,) = out["results"]
    assert res["next_token"]["text"] == " Paris"
    assert res["prompt_tokens"] == 5 and res["cached_tokens"] == 0
    assert res["prompt_logprobs"] is None
    top = res["top_logprobs"]
    assert len(top) == 5 and top[0]["id"] == res["next_token"]["id"]
    assert top[0]["logprob"] == pytest.approx(res["next_token"]["logprob"])
    assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))
    assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-5
    assert res["queue_ms"] >= 0 and res["prefill_ms"] > 0
    assert out["usage"] == {"prompt_tokens": 5, "cached_tokens": 0}


def test_input_forms_agree(api, core) -> None:
    ids = core.tokenizer.encode(FRANCE)
    a = prefill(api, prompt=FRANCE)["results"][0]["next_token"]
    b = prefill(api, input_ids=ids)["results"][0]["next_token"]
    many = prefill(api, prompts=[FRANCE, "Hello"])["results"]
    many_ids = prefill(api, input_ids=[ids, core.tokenizer.encode("Hello")])["results"]
    assert a["id"] == b["id"] == many[0]["next_token"]["id"] == many_ids[0]["next_token"]["id"]
    assert [r["index"] for r in many] == [0, 1]
    assert many[1]["next_token"]["id"] == many_ids[1]["next_token"]["id"]


def test_prompt_logprobs_match_manual(api, core) -> None:
    """Each prompt token's logprob equals log_softmax of the solo forward of its prefix."""
    res = prefill(api, prompt=FRANCE, prompt_logprobs=True, top_logprobs=2)["results"][0]
    plp = res["prompt_logprobs"]
    ids = core.tokenizer.encode(FRANCE)
    assert [p["id"] for p in plp] == ids
    assert plp[0]["logprob"] is None and plp[0]["top_logprobs"] is None
    for i in (2, 4):  # prefix of i tokens predicts token i
        solo = prefill(api, input_ids=ids[:i], top_logprobs=20)["results"][0]["top_logprobs"]
        exact = torch.log_softmax(core.prefill_chunked(ids[:i]).float(), -1)[ids[i]].item()
        assert plp[i]["logprob"] == pytest.approx(exact, abs=1e-4)
        assert plp[i]["top_logprobs"][0]["id"] == solo[0]["id"]
        assert len(plp[i]["top_logprobs"]) == 2


def test_seeded_sampling_is_reproducible(api) -> None:
    body = dict(prompt="Once upon a time", temperature=1.5, top_p=0.95, top_k=50)
    picks = {prefill(api, seed=7, **body)["results"][0]["next_token"]["id"] for _ in range(3)}
    assert len(picks) == 1
    seeds = {prefill(api, seed=s, **body)["results"][0]["next_token"]["id"] for s in range(12)}
    assert len(seeds) > 1, "different seeds should explore different tokens at T=1.5"
    greedy = prefill(api, prompt=FRANCE, temperature=0.9, top_k=1)["results"][0]
    assert greedy["next_token"]["text"] == " Paris"


def _hist(api, name: str) -> dict[str, float]:
    fams = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    return {s.labels.get("le", s.name): s.value for s in fams[name].samples
            if s.name.endswith("_bucket")}


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The quick brown fox", "1, 2, 3, 4,", "My favourite colour is", "Hello", "In 1969,"]


def test_concurrent_requests_are_batched_and_match_solo(api) -> None:
    solo = [prefill(api, prompt=p, top_logprobs=3)["results"][0] for p in PROMPTS]
    api.engine.delay_s = 0.2  # let the queue fill while the first forward runs

    async def burst():
        return await asyncio.gather(*(api.client.post(
            "/v1/prefill", json={"prompt": p, "top_logprobs": 3}) for p in PROMPTS))

    together = [r.json()["results"][0] for r in api.run(burst())]
    for s, t in zip(solo, together):
        assert t["next_token"]["id"] == s["next_token"]["id"]
        assert t["next_token"]["logprob"] == pytest.approx(s["next_token"]["logprob"], abs=1e-4)
        assert [x["id"] for x in t["top_logprobs"]] == [x["id"] for x in s["top_logprobs"]]
    batches = _hist(api, "prefill_batch_requests")
    assert batches["+Inf"] > batches["1.0"], f"no forward had more than one prompt: {batches}"
    assert any(len(f) > 1 for f in api.engine.forwards)


def test_long_prompt_is_chunked_and_matches_whole(make_app, core) -> None:
    whole_app = make_app()
    text = " ".join(PROMPTS * 3)
    whole = prefill(whole_app, prompt=text, prompt_logprobs=True)["results"][0]
    chunked_app = make_app(max_batch_tokens=16)
    chunked = prefill(chunked_app, prompt=text, prompt_logprobs=True)["results"][0]
    n = whole["prompt_tokens"]
    assert n > 48
    assert len(chunked_app.engine.forwards) >= n // 16
    assert max(sum(len(c) for c in f) for f in chunked_app.engine.forwards) <= 16
    assert chunked["next_token"]["id"] == whole["next_token"]["id"]
    assert chunked["next_token"]["logprob"] == pytest.approx(whole["next_token"]["logprob"],
                                                             abs=1e-4)
    for a, b in zip(chunked["prompt_logprobs"][1:], whole["prompt_logprobs"][1:]):
        assert a["id"] == b["id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_prefix_cache_reuse_matches_recompute(make_app) -> None:
    text = " ".join(PROMPTS * 2)  # ~70 tokens: 4 full 16-token pages
    live = make_app()
    cold = prefill(live, prompt=text, top_logprobs=5)["results"][0]
    warm = prefill(live, prompt=text + " and then", top_logprobs=5)["results"][0]
    again = prefill(live, prompt=text, top_logprobs=5)["results"][0]
    n = cold["prompt_tokens"]
    assert cold["cached_tokens"] == 0
    assert warm["cached_tokens"] == (n // 16) * 16
    assert again["cached_tokens"] == ((n - 1) // 16) * 16
    assert again["next_token"]["id"] == cold["next_token"]["id"]
    assert again["next_token"]["logprob"] == pytest.approx(cold["next_token"]["logprob"], abs=1e-4)
    for a, b in zip(again["top_logprobs"], cold["top_logprobs"]):
        assert a["id"] == b["id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    metrics = live.get("/metrics").text
    cached = warm["cached_tokens"] + again["cached_tokens"]
    assert metric(metrics, "prefill_cached_tokens_total") == cached
    assert metric(metrics, "prefill_kv_used_tokens") == 0
    info = live.get("/info").json()
    assert info["prefix_cache"] is True and info["kv"]["prefix_cached_tokens"] >= 64
    off = make_app(prefix_cache="false")
    prefill(off, prompt=text)
    assert prefill(off, prompt=text)["results"][0]["cached_tokens"] == 0


def test_small_bodies_are_tokenized_on_the_loop_large_ones_in_a_thread(api, monkeypatch) -> None:
    """Bodies up to INLINE_BODY_BYTES skip the worker-thread hop; larger ones (a long prompt's
    tokenizing can take seconds) still leave the event loop. Both answer alike."""
    from service.api import prompts as runner

    hops = []
    real = runner.asyncio.to_thread

    async def counted(fn, *args):
        hops.append(fn.__name__)
        return await real(fn, *args)

    monkeypatch.setattr(runner.asyncio, "to_thread", counted)
    small = prefill(api, prompt=FRANCE)["results"][0]
    assert hops == []
    padded = FRANCE + " " * (runner.INLINE_BODY_BYTES + 10)  # the tokenizer keeps the spaces
    big = prefill(api, prompt=padded)["results"][0]
    assert hops == ["prompt_ids"]
    assert big["prompt_tokens"] > small["prompt_tokens"]


def test_the_answer_is_what_its_schema_writes(api) -> None:
    """The answer is built as plain data: it is what PrefillResponse dumps, field for field and
    in order, with and without prompt logprobs, alternatives and named tokens."""
    from service.api.native.prefill import PrefillResponse

    for body in ({"prompt": FRANCE},
                 {"prompts": [FRANCE, "Hi"], "prompt_logprobs": True, "top_logprobs": 3,
                  "logprob_token_ids": [5, 6]}):
        out = prefill(api, **body)
        assert json.dumps(PrefillResponse.model_validate(out).model_dump(mode="json")) == (
            json.dumps(out))


def test_a_large_answer_is_built_off_the_event_loop(api, monkeypatch) -> None:
    """An answer of more than INLINE_LOGPROBS logprobs is built in a thread: while its build is
    held, the app's event loop answers /health; then the answer completes."""
    from service.api.deps import INLINE_LOGPROBS

    gate, building = threading.Event(), threading.Event()
    real = api.state.tokenizer.token_text

    def held(t: int) -> str:
        building.set()
        gate.wait(60)
        return real(t)

    text = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens x 21 logprobs
    monkeypatch.setattr(api.state.tokenizer, "token_text", held)
    big = api.submit(api.client.post("/v1/prefill", json={
        "prompt": text, "prompt_logprobs": True, "top_logprobs": 20}))
    try:
        assert building.wait(60)
        health = api.run(api.client.get("/health"), timeout=30)  # a held loop: TimeoutError
        assert health.status_code == 200 and not big.done()
    finally:
        gate.set()
    res = big.result(60).json()["results"][0]
    assert res["prompt_tokens"] * 21 > INLINE_LOGPROBS
    assert res["prompt_logprobs"][-1]["text"] == real(res["prompt_logprobs"][-1]["id"])


def test_named_token_logprobs_whatever_their_rank(api, core) -> None:
    """`logprob_token_ids`: each named token's next-token logprob, in the order asked, equal to
    log_softmax of the prompt's own last logits, also for tokens far outside the top 20; with
    prompt_logprobs, at every prompt position too; sampling leaves them unchanged."""
    ids = core.tokenizer.encode(FRANCE)
    exact = torch.log_softmax(core.prefill_chunked(ids).float(), -1)
    ranked = torch.argsort(exact, descending=True).tolist()
    named = [ranked[0], ranked[500], ranked[-1], ranked[3]]  # top, mid, last, top-5
    for extra in ({}, {"temperature": 1.0, "seed": 3}):
        res = prefill(api, prompt=FRANCE, logprob_token_ids=named, **extra)["results"][0]
        got = res["token_logprobs"]
        assert [t["id"] for t in got] == named
        for t in got:
            assert t["logprob"] == pytest.approx(exact[t["id"]].item(), abs=1e-4)
            assert t["text"] == core.tokenizer.token_text(t["id"])
    assert prefill(api, prompt=FRANCE)["results"][0]["token_logprobs"] is None
    res = prefill(api, prompt=FRANCE, prompt_logprobs=True, logprob_token_ids=named[:2])
    plp = res["results"][0]["prompt_logprobs"]
    assert plp[0]["token_logprobs"] is None
    at2 = torch.log_softmax(core.prefill_chunked(ids[:2]).float(), -1)
    assert [t["logprob"] for t in plp[2]["token_logprobs"]] == pytest.approx(
        [at2[t].item() for t in named[:2]], abs=1e-4)


@pytest.mark.parametrize("named, field, says", [
    ([1, 49152], "logprob_token_ids[1]", "not a token id"),
    ([-1], "logprob_token_ids[0]", "not a token id"),
    ([], "logprob_token_ids", "at least 1"),
    (list(range(257)), "logprob_token_ids", "at most 256"),
])
def test_bad_named_tokens_are_a_400_naming_the_field(api, named, field, says) -> None:
    r = api.post("/v1/prefill", json={"prompt": FRANCE, "logprob_token_ids": named})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and says in err["message"], err
