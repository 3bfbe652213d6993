"""What vLLM, llm-d and lm-eval clients send: unknown fields accepted and logged once, vLLM's
sampling fields honoured with its meaning, the completions extras in vLLM's shape, and every
numeric field at its type's extremes a 4xx or a 200, never a 5xx."""

from __future__ import annotations

import json
import logging

import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
FRANCE = "The capital of France is"
EOS = 2  # <|im_end|>


def complete(api, **body) -> dict:
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": FRANCE, "max_tokens": 1,
                                          **body})
    assert r.status_code == 200, r.text
    return r.json()


def choice(api, **body) -> dict:
    return complete(api, **body)["choices"][0]


def test_unknown_fields_are_ignored_and_logged_once_per_name(api, caplog) -> None:
    bodies = {"/v1/prefill": {"prompt": FRANCE},
              "/v1/completions": {"prompt": FRANCE, "max_tokens": 1},
              "/v1/score": {"query": FRANCE, "items": [" Paris"], "label_token_ids": [7042]}}
    with caplog.at_level(logging.WARNING, logger="service.api"):
        for _ in range(3):
            for route, body in bodies.items():
                r = api.post(route, json={**body, "zz_unknown_field": {"x": [1, 2]},
                                          "do_sample": False})
                assert r.status_code == 200, (route, r.text)
    lines = [r.getMessage() for r in caplog.records if r.name == "service.api"]
    for name in ("zz_unknown_field", "do_sample"):
        assert sum(name in ln for ln in lines) <= 1, lines
    assert api.post("/v1/completions", json={**bodies["/v1/completions"],
                                             "zz_unknown_field": 1}).status_code == 200


def test_what_llm_d_sends_a_prefill_pod_is_served(api) -> None:
    """The P/D sidecar's prefill leg: the client's body with max_tokens and
    max_completion_tokens 1, stream false, min_tokens, cache_hit_threshold and kv_transfer_params
    asking for a remote decode. The answer is a completion whose kv_transfer_params is null, as
    vLLM's server without a KV connector answers."""
    body = {"model": MODEL, "prompt": FRANCE, "max_tokens": 1, "max_completion_tokens": 1,
            "min_tokens": 1, "stream": False, "temperature": 0, "cache_hit_threshold": 0.5,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}
    r = api.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert "kv_transfer_params" in out and out["kv_transfer_params"] is None
    assert out["choices"][0]["text"] == " Paris" and out["usage"]["completion_tokens"] == 1


def test_what_lm_eval_and_openai_style_clients_send_is_served(api) -> None:
    out = choice(api, do_sample=False, repetition_penalty=1.0, min_p=0.0, stop=["\n\n"], n=1,
                 stream=False, top_k=-1, seed=1234, user="me", stream_options=None)
    assert out["text"] == " Paris"
    assert choice(api, top_k=-1, temperature=0.7, seed=3) == choice(api, top_k=0,
                                                                    temperature=0.7, seed=3)
    assert choice(api, max_tokens=None, max_completion_tokens=0)["text"] == ""


def test_repetition_penalty_keeps_the_prompts_tokens_from_coming_first(api) -> None:
    prompt = "A B C A B C A B C A B"  # the greedy token, " C", is one of the prompt's
    ids = api.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                            "return_token_ids": True}).json()
    plain = ids["choices"][0]["token_ids"][0]
    assert plain in ids["choices"][0]["prompt_token_ids"]  # the raw winner repeats the prompt
    out = choice(api, prompt=prompt, repetition_penalty=1e4, return_token_ids=True, logprobs=1)
    assert out["token_ids"][0] not in out["prompt_token_ids"]
    raw = choice(api, prompt=prompt, logprobs=20, max_tokens=1)["logprobs"]["top_logprobs"][0]
    picked = out["logprobs"]["tokens"][0]
    assert out["logprobs"]["token_logprobs"][0] == pytest.approx(raw[picked], abs=1e-5)


def test_logit_bias_min_tokens_and_stop_token_ids(api) -> None:
    forced = choice(api, logit_bias={str(EOS): 100}, return_token_ids=True)
    assert forced["token_ids"] == [EOS] and forced["finish_reason"] == "stop"
    assert forced["text"] == "" and forced["stop_reason"] is None
    kept = choice(api, logit_bias={str(EOS): 100}, min_tokens=1, return_token_ids=True)
    assert kept["token_ids"] != [EOS]
    as_stop = choice(api, logit_bias={"11": 100}, stop_token_ids=[11])
    assert as_stop["finish_reason"] == "stop" and as_stop["stop_reason"] == 11
    assert as_stop["text"] == ""
    only = choice(api, allowed_token_ids=[11, 12], return_token_ids=True)
    assert only["token_ids"][0] in (11, 12)
    ignored = choice(api, logit_bias={str(EOS): 100}, ignore_eos=True)
    assert ignored["finish_reason"] == "length"


def test_prompt_logprobs_in_vllms_shape(api) -> None:
    """Per choice: null for the first token, then a dict keyed by token id holding the prompt
    token (logprob, rank, decoded_token) and the top alternatives; the same logprobs as
    echo."""
    out = choice(api, max_tokens=0, prompt_logprobs=3, return_token_ids=True)
    ids, plps = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    echo = choice(api, max_tokens=0, echo=True, logprobs=0)["logprobs"]["token_logprobs"]
    for pos, (tok, entry) in enumerate(zip(ids[1:], plps[1:]), start=1):
        own = entry[str(tok)]
        assert own["logprob"] == pytest.approx(echo[pos], abs=1e-5) and own["rank"] >= 1
        assert own["decoded_token"] == api.state.tokenizer.token_text(tok)
        ranked = sorted((v for k, v in entry.items() if k != str(tok) or v["rank"] <= 3),
                        key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3]
        assert 3 <= len(entry) <= 4
    assert out["token_ids"] == [] and out["text"] == ""


def test_tokens_as_ids_truncation_and_special_tokens(api) -> None:
    ids = list(range(100, 110))
    cut = choice(api, prompt=ids, truncate_prompt_tokens=4, return_token_ids=True)
    assert cut["prompt_token_ids"] == ids[-4:]
    text = choice(api, prompt="abc def ghi jkl", truncate_prompt_tokens=2, return_token_ids=True)
    assert len(text["prompt_token_ids"]) == 2
    named = choice(api, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    assert named["logprobs"]["tokens"] == [f"token_id:{named['token_ids'][0]}"]
    assert all(k.startswith("token_id:") for k in named["logprobs"]["top_logprobs"][0])
    tok = api.state.tokenizer
    tok.add_bos = True  # a tokenizer that adds BOS, as Llama's does
    try:
        with_bos = choice(api, return_token_ids=True)["prompt_token_ids"]
        without = choice(api, return_token_ids=True, add_special_tokens=False)
    finally:
        tok.add_bos = False
    assert with_bos[0] == tok.bos_id and without["prompt_token_ids"] == with_bos[1:]


def test_model_cards_have_a_parent(api) -> None:
    card = api.get("/v1/models").json()["data"][0]
    assert "parent" in card and card["parent"] is None


EXTREMES = [1 << 63, -(1 << 63), 1 << 64, 10**30, float("nan"), float("inf"), float("-inf"),
            -0.0, 1e-300]
NUMERIC = {  # route -> (a valid body, {field: where the value goes})
    "/v1/prefill": ({"prompt": "a"}, {
        f: (lambda v, f=f: {f: v}) for f in (
            "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "min_tokens", "priority",
            "truncate_prompt_tokens", "top_logprobs")} | {
        "logit_bias": lambda v: {"logit_bias": {"5": v}},
        "input_ids": lambda v: {"prompt": None, "input_ids": [1, v]},
        "logprob_token_ids": lambda v: {"logprob_token_ids": [v]},
        "allowed_token_ids": lambda v: {"allowed_token_ids": [v]},
        "stop_token_ids": lambda v: {"stop_token_ids": [v]}}),
    "/v1/completions": ({"prompt": "a"}, {
        f: (lambda v, f=f: {f: v}) for f in (
            "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "max_tokens", "max_completion_tokens", "logprobs", "prompt_logprobs", "n",
            "best_of", "min_tokens")} | {
        "prompt": lambda v: {"prompt": [v]},
        "logit_bias": lambda v: {"logit_bias": {"5": v}}}),
    "/v1/score": ({"query": [1], "items": [[2]], "label_token_ids": [3]}, {
        "query": lambda v: {"query": [v]},
        "items": lambda v: {"items": [[v]]},
        "label_token_ids": lambda v: {"label_token_ids": [v]}}),
}
CASES = [(route, field) for route, (_, fields) in NUMERIC.items() for field in fields]


@pytest.mark.parametrize("route,field", CASES, ids=[f"{r}:{f}" for r, f in CASES])
def test_every_numeric_field_at_its_extremes_is_a_4xx_or_a_200(api, route, field) -> None:
    base, fields = NUMERIC[route]
    for v in EXTREMES:
        body = {k: x for k, x in {**base, **fields[field](v)}.items() if x is not None}
        raw = json.dumps(body, allow_nan=True)  # NaN / Infinity as Python's json writes them
        r = api.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, (field, v, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["param"] is None or err["param"].split("[")[0].split(".")[0] == field, (
                field, v, err)


FIRST_TOKEN = {  # route -> (a body, the id of the answer's first token)
    "/v1/prefill": ({"prompt": FRANCE}, lambda out: out["results"][0]["next_token"]["id"]),
    "/v1/completions": ({"prompt": FRANCE, "max_tokens": 1, "return_token_ids": True},
                        lambda out: out["choices"][0]["token_ids"][0]),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": FRANCE}],
                              "return_token_ids": True},
                             lambda out: out["choices"][0]["token_ids"][0]),
}


@pytest.mark.parametrize("route", FIRST_TOKEN)
def test_logit_bias_keys_are_read_as_vllm_reads_them(api, route) -> None:
    """vLLM's int(key): what Python reads as an integer is that token (spaces, a sign, "_",
    leading zeros, any script's digits); anything else is a 400 naming logit_bias, never a 500."""
    body, first = FIRST_TOKEN[route]

    def forced(key: str) -> int:
        r = api.post(route, json={**body, "logit_bias": {key: 100}})
        assert r.status_code == 200, (key, r.text)
        return first(r.json())

    assert forced("42") == 42 and forced("0") == 0
    for key in (" 42 ", "+42", "4_2", "0042", "٤٢", "４２", "𝟒𝟐"):
        assert forced(key) == 42, key
    assert forced("-0") == 0
    for key in ("²", "--1", "9" * 5000, "4 2", "0x2a", "1e3", "", "-"):
        r = api.post(route, json={**body, "logit_bias": {key: 1}})
        assert r.status_code == 400, (key[:20], r.text)
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and "not a token id" in err["message"], err


def test_unknown_field_names_are_bounded_in_memory_and_log_lines(api, caplog) -> None:
    """Each name reported once, at most one line a minute (a count and a few names), at most
    MAX_NAMES names remembered: 3 requests of 100k invented names write at most one line."""
    from service.api import fields

    with caplog.at_level(logging.WARNING, logger="service.api"):
        for i in range(3):
            raw = json.dumps({"prompt": FRANCE, "max_tokens": 1,
                              **{f"zz{i}_{j}": 1 for j in range(100_000)}})
            r = api.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
    assert len([r for r in caplog.records if r.name == "service.api"]) <= 1
    assert len(fields._unknown.seen) <= fields.MAX_NAMES

    now = [0.0]
    unknown = fields.UnknownFields(clock=lambda: now[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.api"):
        for i in range(3):
            unknown.note("CompletionRequest", {f"k{i}_{j}": 1 for j in range(100_000)})
        (line,) = [r.getMessage() for r in caplog.records]
        assert "'k0_0'" in line and "100000" in line and "CompletionRequest" in line
        unknown.note("CompletionRequest", {"k0_0": 1})  # seen: nothing new to say
        now[0] += fields.REPORT_EVERY_S
        unknown.report()  # what the timer does at the end of the quiet minute
        assert len(caplog.records) == 2 and "2 request(s)" in caplog.records[1].getMessage()
    assert len(unknown.seen) == 3 * fields.NAMES_READ <= fields.MAX_NAMES
