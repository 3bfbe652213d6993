"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info, also under /v1/): vLLM's
shapes, the calls lm-eval's remote tokenizer makes, errors that name the field, API_KEY."""

from __future__ import annotations

import pytest

from service.model.tokenizer import TextTokenizer
from service.model.tokenizer_export import tokenizer_config

PREFIXES = ("", "/v1")
TEXT = "Hello, world! <|im_start|>user\n12 cafés<|im_end|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def error(r, status: int, param: str | None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_tokenize_shape(api, tokenizer, prefix) -> None:
    out = ok(api.post(f"{prefix}/tokenize", json={"prompt": TEXT}))
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == tokenizer.encode(TEXT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == api.state.max_prompt_tokens == 8192  # SmolLM2's context
    assert out["token_strs"] is None
    assert out["tokens"][5] == tokenizer.bos_id  # special tokens in the text stay whole


def test_token_strs_are_vocabulary_entries(api) -> None:
    out = ok(api.post("/tokenize", json={"prompt": "Hello, world!", "return_token_strs": True}))
    assert out["token_strs"] == ["Hello", ",", "Ġworld", "!"]


def test_add_special_tokens_adds_the_bos_the_tokenizer_adds(api, tokenizer) -> None:
    # SmolLM2 adds no BOS: both settings give the same ids
    plain = ok(api.post("/tokenize", json={"prompt": "Hi"}))["tokens"]
    assert ok(api.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False})
              )["tokens"] == plain
    api.state.tokenizer = TextTokenizer(tokenizer.tok, tokenizer.bos_id, tokenizer.eos_id,
                                        add_bos=True, pad_id=tokenizer.pad_id)
    assert ok(api.post("/tokenize", json={"prompt": "Hi"}))["tokens"] == [tokenizer.bos_id,
                                                                          *plain]
    assert ok(api.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False})
              )["tokens"] == plain
    assert ok(api.get("/tokenizer_info"))["add_bos_token"] is True


def test_empty_prompt_has_no_tokens(api) -> None:
    assert ok(api.post("/tokenize", json={"prompt": ""}))["count"] == 0


@pytest.mark.parametrize("prefix", PREFIXES)
def test_detokenize_round_trips(api, tokenizer, prefix) -> None:
    out = ok(api.post(f"{prefix}/detokenize", json={"tokens": tokenizer.encode(TEXT)}))
    assert out == {"prompt": TEXT}
    assert ok(api.post(f"{prefix}/detokenize", json={"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize("bad", [49152, -1, (1 << 31) - 1])
def test_detokenize_refuses_ids_outside_the_vocabulary(api, bad) -> None:
    msg = error(api.post("/detokenize", json={"tokens": [1, bad]}), 400, "tokens[1]")
    assert str(bad) in msg and "49152" in msg


@pytest.mark.parametrize("prefix", PREFIXES)
def test_tokenizer_info_is_the_tokenizer_config(api, tokenizer, prefix) -> None:
    out = ok(api.get(f"{prefix}/tokenizer_info"))
    assert out == tokenizer_config(tokenizer, api.state.max_prompt_tokens)
    assert out["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (out["bos_token"], out["eos_token"], out["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert out["add_bos_token"] is False and out["model_max_length"] == 8192
    assert out["chat_template"] == tokenizer.chat_template and "<|im_start|>" in out[
        "chat_template"]


def test_lm_eval_remote_tokenizer_calls(api, tokenizer) -> None:
    """What lm-eval's RemoteTokenizer reads: eos/bos/pad tokens and chat_template from
    /tokenizer_info, their ids as the first token of /tokenize without special tokens, text back
    from /detokenize (at the server's root: it strips /v1/completions from base_url)."""
    info = ok(api.get("/tokenizer_info"))
    for name, want in (("eos_token", tokenizer.eos_id), ("bos_token", tokenizer.bos_id)):
        out = ok(api.post("/tokenize", json={"prompt": info[name], "add_special_tokens": False}))
        assert out["tokens"][0] == want
    assert isinstance(ok(api.post("/tokenize", json={"prompt": "test",
                                                     "add_special_tokens": False}))["tokens"],
                      list)
    assert ok(api.post("/detokenize", json={"tokens": [19556, 28, 905]}))["prompt"] == (
        "Hello, world")


def test_lm_eval_remote_tokenizer_against_the_server(served, tokenizer) -> None:
    """lm-eval's own client (a test extra: a missing install fails here rather than skipping)."""
    from lm_eval import utils

    url = served()
    assert utils.check_remote_tokenizer_support(f"{url}/v1/completions")
    remote = utils.RemoteTokenizer(f"{url}/v1/completions")
    assert (remote.bos_token_id, remote.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    assert remote.encode(TEXT) == tokenizer.encode(TEXT, False)
    assert remote.batch_decode([tokenizer.encode(TEXT)]) == [TEXT]
    chat = [{"role": "user", "content": "Hi"}]
    assert remote.apply_chat_template(chat).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body, param, words", [
    ({}, None, "exactly one of prompt"),
    ({"prompt": "a", "messages": CHAT}, None, "got both"),
    ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt", "messages"),
    ({"prompt": "a", "chat_template": "{{ 1 }}"}, "chat_template", "messages"),
    ({"prompt": 3}, "prompt", "string"),
    ({"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens", "boolean"),
])
def test_tokenize_bad_input_names_the_field(api, body, param, words) -> None:
    assert words in error(api.post("/tokenize", json=body), 400, param)


def test_lone_surrogate_is_refused(api) -> None:
    r = api.post("/tokenize", content=b'{"prompt": "a\\ud800"}',
                 headers={"Content-Type": "application/json"})
    assert "surrogate" in error(r, 400, "prompt")


@pytest.mark.parametrize("prefix", PREFIXES)
def test_chat_form_renders_the_models_template(api, tokenizer, prefix) -> None:
    """messages: the model's template rendered (generation prompt by default), then tokenized
    without a BOS of the tokenizer's (the template writes its own special tokens)."""
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n")
    out = ok(api.post(f"{prefix}/tokenize", json={"messages": CHAT, "return_token_strs": True}))
    assert out["tokens"] == tokenizer.encode(text, False) and out["count"] == len(out["tokens"])
    assert out["token_strs"][:2] == ["<|im_start|>", "system"]
    bare = ok(api.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}))
    assert bare["tokens"] == tokenizer.encode(text.removesuffix("<|im_start|>assistant\n"))
    cont = [*CHAT, {"role": "assistant", "content": "Hel"}]
    out = ok(api.post("/tokenize", json={"messages": cont, "continue_final_message": True}))
    assert tokenizer.decode(out["tokens"]).endswith("<|im_start|>assistant\nHel")


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
])
def test_chat_form_bad_input_names_the_field(api, body, param) -> None:
    error(api.post("/tokenize", json=body), 400, param)


def test_detokenize_bad_input_names_the_field(api) -> None:
    error(api.post("/detokenize", json={}), 400, "tokens")
    error(api.post("/detokenize", json={"tokens": [1, "2"]}), 400, "tokens[1]")


def test_unknown_fields_are_ignored_and_other_models_refused(api) -> None:
    assert ok(api.post("/tokenize", json={"prompt": "Hi", "priority_hint": 3}))["count"] == 1
    r = api.post("/detokenize", json={"model": "gpt-4", "tokens": [1]})
    assert error(r, 404, "model")
    assert ok(api.post("/detokenize", json={"model": api.state.model_name, "tokens": [1]}))


def test_api_key_guards_every_tokenizer_route(make_app) -> None:
    app = make_app(api_key="s3cret")
    good = {"Authorization": "Bearer s3cret"}
    for prefix in PREFIXES:
        calls = ((app.post, f"{prefix}/tokenize", {"json": {"prompt": "Hi"}}),
                 (app.post, f"{prefix}/detokenize", {"json": {"tokens": [1]}}),
                 (app.get, f"{prefix}/tokenizer_info", {}))
        for call, path, kw in calls:
            assert call(path, **kw).status_code == 401, path
            assert call(path, headers={"Authorization": "Bearer no"}, **kw).status_code == 401
            assert call(path, headers=good, **kw).status_code == 200, path
