"""POST /v1/completions (OpenAI legacy shape), including the official `openai` client."""

from __future__ import annotations

import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
FRANCE = "The capital of France is"


def complete(api, **body):
    r = api.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_shape(api) -> None:
    out = complete(api, prompt=FRANCE, max_tokens=1)
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["id"].startswith("cmpl-") and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice == {"index": 0, "text": " Paris", "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": None,
                      "token_ids": None}  # vLLM's choice, its optional fields null
    assert out["kv_transfer_params"] is None
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_logprobs_and_lists(api, core) -> None:
    out = complete(api, prompt=[FRANCE, "Hello"], max_tokens=1, logprobs=3)
    a, b = out["choices"]
    assert (a["index"], b["index"]) == (0, 1)
    lp = a["logprobs"]
    assert lp["tokens"] == [" Paris"] and lp["text_offset"] == [len(FRANCE)]
    assert " Paris" in lp["top_logprobs"][0] and len(lp["top_logprobs"][0]) == 3
    ids = core.tokenizer.encode(FRANCE)
    by_ids = complete(api, prompt=[ids], max_tokens=1)["choices"][0]
    assert by_ids["text"] == " Paris"
    assert complete(api, prompt=ids, max_tokens=1)["choices"][0]["text"] == " Paris"


def test_echo_scoring_matches_prefill(api) -> None:
    """max_tokens=0 + echo + logprobs: how scoring clients read prompt logprobs."""
    out = complete(api, prompt=FRANCE, max_tokens=0, echo=True, logprobs=1)
    (choice,) = out["choices"]
    assert choice["text"] == FRANCE and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == FRANCE
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 3, 11, 14, 21]
    assert out["usage"]["completion_tokens"] == 0
    native = api.post("/v1/prefill", json={"prompt": FRANCE, "prompt_logprobs": True}).json()
    want = [p["logprob"] for p in native["results"][0]["prompt_logprobs"]]
    assert lp["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-5)
    echo1 = complete(api, prompt=FRANCE, max_tokens=1, echo=True, logprobs=0)["choices"][0]
    assert echo1["text"] == FRANCE + " Paris" and echo1["logprobs"]["tokens"][-1] == " Paris"


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 2}, "max_tokens"),
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"49152": 1.0}}, "logit_bias[0]"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias.5"),
    ({"allowed_token_ids": [3, 49152]}, "allowed_token_ids[1]"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"bad_words": ["Paris"]}, "bad_words"),
    ({"priority": 3}, "priority"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"model": "gpt-3.5-turbo-instruct"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], [49152]]}, "prompt[1][0]"),
])
def test_refused(api, body, param) -> None:
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param in ("max_tokens", "stream", "n", "best_of"):
        assert "prefill service" in err["message"]


def test_openai_client_matches_prefill(served) -> None:
    import openai

    url = served(api_key="sk-test")
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    model = client.models.list().data[0].id
    assert model == MODEL
    out = client.completions.create(model=model, prompt=FRANCE, max_tokens=1, logprobs=2)
    import httpx

    native = httpx.post(url + "/v1/prefill", json={"prompt": FRANCE},
                        headers={"Authorization": "Bearer sk-test"}).json()["results"][0]
    assert out.choices[0].text == native["next_token"]["text"] == " Paris"
    assert out.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        native["next_token"]["logprob"], abs=1e-5)
    assert out.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="prefill service"):
        client.completions.create(model=model, prompt=FRANCE, max_tokens=16)
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt=FRANCE, max_tokens=1)


def test_logprob_token_ids_replace_the_top_logprobs(api, core) -> None:
    """vLLM's extension: with logprobs set, each position's top_logprobs lists the named tokens
    (and the chosen one), with the logprobs /v1/prefill reports for them."""
    ids = core.tokenizer.encode(FRANCE)
    named = [core.tokenizer.encode(" London")[0], core.tokenizer.encode(" banana")[0]]
    want = api.post("/v1/prefill", json={"input_ids": ids, "logprob_token_ids": named,
                                         "prompt_logprobs": True}).json()["results"][0]
    out = complete(api, prompt=ids, max_tokens=1, logprobs=1, echo=True,
                   logprob_token_ids=named)
    lp = out["choices"][0]["logprobs"]
    text = core.tokenizer.token_text
    last = lp["top_logprobs"][-1]
    assert set(last) == {text(named[0]), text(named[1]), " Paris"}
    for t in want["token_logprobs"]:
        assert last[t["text"]] == pytest.approx(t["logprob"], abs=1e-5)
    at3 = lp["top_logprobs"][3]  # echo: the prompt position predicting token 3
    for t in want["prompt_logprobs"][3]["token_logprobs"]:
        assert at3[t["text"]] == pytest.approx(t["logprob"], abs=1e-5)
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": FRANCE,
                                          "logprob_token_ids": named})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids"
