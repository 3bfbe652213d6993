"""POST /v1/chat/completions: OpenAI's chat shape with vLLM's extras, the prompt rendered with
the model's chat template, the official `openai` client, and the 400s that name the field."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from service.api.openai.chat_template import render

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [{"role": "system", "content": "Answer with one word."},
       {"role": "user", "content": "What is the capital of France?"}]


def chat(api, **body) -> dict:
    r = api.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()


def rendered(api, messages=ASK, **kw) -> str:
    kw.setdefault("add_generation_prompt", True)
    return render(api.state.tokenizer, messages, continue_final_message=False, **kw)


def prefill(api, text: str, **body) -> dict:
    r = api.post("/v1/prefill", json={"prompt": text, **body})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def test_chat_shape_and_first_token(api) -> None:
    out = chat(api, max_tokens=1, logprobs=True, top_logprobs=2)
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["id"].startswith("chatcmpl-") and isinstance(out["created"], int)
    want = prefill(api, rendered(api), top_logprobs=2)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": want["next_token"]["text"]}
    (lp,) = choice["logprobs"]["content"]
    assert lp["token"] == want["next_token"]["text"]
    assert lp["logprob"] == pytest.approx(want["next_token"]["logprob"], abs=1e-5)
    assert lp["bytes"] == list(lp["token"].encode())
    assert [t["token"] for t in lp["top_logprobs"]] == [t["text"] for t in want["top_logprobs"]]
    usage = out["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        want["prompt_tokens"], 1, want["prompt_tokens"] + 1)
    assert out["prompt_logprobs"] is None and out["kv_transfer_params"] is None


def test_no_bos_unless_asked(api) -> None:
    """The template writes its own special tokens: the tokenizer adds none (vLLM's default)."""
    tok = api.state.tokenizer
    text = rendered(api)
    n = chat(api, return_token_ids=True)
    assert n["prompt_token_ids"] == tok.encode(text, False)
    api.state.tokenizer = with_bos = copy.copy(tok)
    with_bos.add_bos = True
    plain = chat(api, return_token_ids=True)["prompt_token_ids"]
    extra = chat(api, return_token_ids=True, add_special_tokens=True)["prompt_token_ids"]
    assert plain == n["prompt_token_ids"] and extra == [tok.bos_id, *plain]


def test_max_tokens_0_and_echo_score_the_prompt(api) -> None:
    """max_tokens 0: no token, content "". echo: vLLM's prompt_logprobs of the rendered prompt
    (with top_logprobs alternatives)."""
    out = chat(api, max_completion_tokens=0, echo=True, logprobs=True, top_logprobs=1)
    (choice,) = out["choices"]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"content": []} and out["usage"]["completion_tokens"] == 0
    want = prefill(api, rendered(api), prompt_logprobs=True)["prompt_logprobs"]
    got = out["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want) == out["usage"]["prompt_tokens"]
    for g, w in zip(got[1:], want[1:]):
        assert g[str(w["id"])]["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
        assert len(g) in (1, 2)


def test_continue_final_message_and_echo(api) -> None:
    """The assistant's message stays open; add_generation_prompt defaults to false then, and
    echo starts the reply with that message (vLLM)."""
    messages = [*ASK, {"role": "assistant", "content": "The capital is"}]
    text = rendered(api, messages, add_generation_prompt=False)
    text = text[:text.rindex("The capital is") + len("The capital is")]
    want = prefill(api, text)["next_token"]["text"]
    out = chat(api, messages=messages, continue_final_message=True, echo=True)
    assert out["choices"][0]["message"] == {"role": "assistant",
                                            "content": "The capital is" + want}
    plain = chat(api, messages=messages, continue_final_message=True)["choices"][0]
    assert plain["message"]["content"] == want


def test_list_of_parts_chat_template_kwargs_and_stop(api) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    a = chat(api, messages=parts, return_token_ids=True)
    assert a["prompt_token_ids"] == chat(api, messages=joined,
                                         return_token_ids=True)["prompt_token_ids"]
    kw = chat(api, messages=joined, chat_template_kwargs={"bos_token": "ignored"})
    # a variable this template does not read changes nothing
    assert kw["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    token = a["choices"][0]["message"]["content"]
    stopped = chat(api, messages=parts, stop=[token])["choices"][0]
    assert stopped["message"]["content"] == "" and stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == token


def test_a_reply_sent_back_as_the_sdk_dumps_it(api, caplog) -> None:
    """OpenAI's reply fields that a template never sees (refusal, annotations, ...) are
    accepted; unknown ones are logged once by name, as unknown request fields are."""
    reply = {"role": "assistant", "content": "Paris", "refusal": None, "annotations": [],
             "audio": None, "function_call": None, "tool_calls": None}
    messages = [*ASK, reply, {"role": "user", "content": "And Italy?"}]
    with caplog.at_level("WARNING", logger="service.api"):
        out = chat(api, messages=messages, return_token_ids=True)
        chat(api, messages=messages)
    plain = [*ASK, {"role": "assistant", "content": "Paris"}, messages[-1]]
    assert out["prompt_token_ids"] == chat(api, messages=plain,
                                           return_token_ids=True)["prompt_token_ids"]
    logged = [r.getMessage() for r in caplog.records if "'annotations'" in r.getMessage()]
    assert len(logged) <= 1
    assert "/v1/chat/completions" in api.get("/openapi.json").json()["paths"]


def test_logprob_token_ids(api) -> None:
    tok = api.state.tokenizer
    named = [tok.encode(" Paris", False)[0], tok.encode("London", False)[0]]
    want = prefill(api, rendered(api), logprob_token_ids=named)
    out = chat(api, logprobs=True, logprob_token_ids=named)
    (lp,) = out["choices"][0]["logprobs"]["content"]
    top = {t["token"]: t["logprob"] for t in lp["top_logprobs"]}
    for t in want["token_logprobs"]:
        assert top[t["text"]] == pytest.approx(t["logprob"], abs=1e-5)
    assert lp["token"] in top


@pytest.mark.parametrize("body,param,words", [
    ({"max_tokens": 2}, "max_tokens", "prefill service"),
    ({"max_completion_tokens": 5, "max_tokens": 1}, "max_completion_tokens", "prefill service"),
    ({"stream": True}, "stream", "prefill service"),
    ({"n": 2}, "n", "prefill service"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"logprob_token_ids": [5]}, "logprob_token_ids", "needs logprobs"),
    ({"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "cannot both"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "constrained decoding"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "model's own"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "set by the request"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs.self", "template itself"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/cat.png"}}]}]}, "messages[0].content[0].type", "text only"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
     "messages[0].content[0].type", "required"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not JSON"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
])
def test_refused(api, body, param, words) -> None:
    r = api.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f",
                                                                     "arguments": "X"}}]}
ARGUMENTS = "messages[2].tool_calls[0].function.arguments"


@pytest.mark.parametrize("body,value,param", [
    ({"messages": [*ASK, CALL]}, json.dumps(nested(100_000)), ARGUMENTS),  # JSON text
    ({"messages": [*ASK, CALL]}, nested(300), ARGUMENTS),
    ({"messages": [*ASK, CALL]}, nested(100_000), ARGUMENTS + ".a.a.a"),  # past the parser
    ({"tools": ["X"]}, nested(300), "tools"),
    ({"documents": ["X"]}, nested(300), "documents"),
    ({"chat_template_kwargs": {"x": "X"}}, nested(300), "chat_template_kwargs"),
], ids=["arguments-text", "arguments", "arguments-100k", "tools", "documents", "kwargs"])
def test_json_nested_too_deep_is_a_400_naming_the_field(api, body, value, param) -> None:
    raw = json.dumps({"model": MODEL, "messages": ASK, **body}).replace('"X"', value)
    r = api.post("/v1/chat/completions", content=raw,
                 headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "more than 128 levels deep" in err["message"], err
    assert err["param"].startswith(param) if param.endswith(".a") else err["param"] == param, err


def test_no_template_and_failing_template(api) -> None:
    tok = api.state.tokenizer
    for template, words in ((None, "no chat template"),
                            ("{{ raise_exception('System role not supported') }}",
                             "System role not supported")):
        api.state.tokenizer = copy.copy(tok)
        api.state.tokenizer.chat_template = template
        r = api.post("/v1/chat/completions", json={"messages": ASK})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages"


def test_openai_client_matches_completions(served) -> None:
    """The official client's chat call gives the first token and logprob that /v1/completions
    gives for the rendered prompt."""
    import openai

    url = served(api_key="sk-test")
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                         logprobs=True, top_logprobs=3)
    text = render(served.live.state.tokenizer, ASK, add_generation_prompt=True,
                  continue_final_message=False)
    ref = client.completions.create(model=MODEL, prompt=text, max_tokens=1, logprobs=3)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == ref.choices[0].text
    first = choice.logprobs.content[0]
    assert first.token == ref.choices[0].logprobs.tokens[0]
    assert first.logprob == pytest.approx(ref.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert {t.token: t.logprob for t in first.top_logprobs} == pytest.approx(
        ref.choices[0].logprobs.top_logprobs[0], abs=1e-4)  # the 2nd reads the prefix cache
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    scored = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=0)
    assert scored.choices[0].message.content == "" and scored.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, stream=True)
    with pytest.raises(openai.BadRequestError, match="prefill service"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
