"""Bodies of up to MAX_BODY_BYTES never hold the worker's event loop: /health answers while
an 8 MB /tokenize, an 8 MB truncated completion or a /detokenize of millions of ids runs; an
over-long prompt is refused by its size alone; long id arrays are parsed exactly."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

# ends in a non-space and starts with a space: the text's tokens are its repeats' tokens
PARAGRAPH = " Internationalization, responsibilities and characteristically understood rules."
REPEATS = 8_000_000 // len(PARAGRAPH)
JSON = {"Content-Type": "application/json"}


def probed(live, request) -> tuple[float, object]:
    """Run `request` (a coroutine) on the app's loop while /health is asked every 20 ms; the
    longest wait for one, and the response."""
    async def run() -> tuple[float, object]:
        task = asyncio.ensure_future(request)
        worst, last = 0.0, time.perf_counter()
        while not task.done():
            assert (await live.client.get("/health")).status_code == 200
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.02), now
        return worst, await task

    return live.run(run(), timeout=300)


def post(live, path: str, body: dict | bytes):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return live.client.post(path, content=content, headers=JSON)


def test_an_8mb_tokenize_leaves_health_answering(api, tokenizer) -> None:
    worst, r = probed(api, post(api, "/tokenize", {"prompt": PARAGRAPH * REPEATS}))
    assert r.status_code == 200, r.text
    assert worst < 1.0, f"/health waited {worst:.2f} s"
    out = r.json()
    one = tokenizer.encode(PARAGRAPH)
    assert out["count"] == len(out["tokens"]) == len(one) * REPEATS
    assert out["tokens"][:len(one)] == out["tokens"][-len(one):] == one


def test_an_8mb_truncated_completion_leaves_health_answering(api, tokenizer) -> None:
    body = {"prompt": PARAGRAPH * REPEATS, "max_tokens": 1, "truncate_prompt_tokens": 5,
            "return_token_ids": True}
    worst, r = probed(api, post(api, "/v1/completions", body))
    assert r.status_code == 200, r.text
    assert worst < 1.0, f"/health waited {worst:.2f} s"
    assert r.json()["choices"][0]["prompt_token_ids"] == tokenizer.encode(PARAGRAPH)[-5:]


def test_detokenize_of_millions_of_ids_leaves_health_answering(api, tokenizer) -> None:
    ids = ",".join(str(i % 10) for i in range(3_900_000))
    worst, r = probed(api, post(api, "/detokenize", f'{{"tokens":[{ids}]}}'.encode()))
    assert r.status_code == 200, r.text[:300]
    assert worst < 1.0, f"/health waited {worst:.2f} s"
    assert r.json()["prompt"] == tokenizer.decode(list(range(10))) * 390_000


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"),
                                         ("/v1/prefill", "prompt"),
                                         ("/v1/chat/completions", "messages")])
def test_an_over_long_prompt_is_refused_by_its_size_alone(api, monkeypatch, path, field) -> None:
    def tokenized(text: str) -> list[int]:
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(api.state.tokenizer, "_ids", tokenized)
    text = "x " * 700_000  # more bytes than 8192 tokens of the longest token (162 bytes)
    body = ({"messages": [{"role": "user", "content": text}]} if field == "messages"
            else {"prompt": text})
    r = api.run(post(api, path, {**body, "max_tokens": 1}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "more than 8192" in err["message"]


def test_a_run_with_no_place_to_cut_is_refused(api) -> None:
    r = api.run(post(api, "/tokenize", {"prompt": "a" * (1 << 20) + "b" * 1000}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "space or punctuation" in err["message"]


def test_a_detokenized_text_is_bounded(make_app, tokenizer) -> None:
    live = make_app(max_body_bytes=4096)  # answers of up to 8 x 4096 bytes
    vocab = tokenizer.tok.get_vocab()
    longest = vocab[max(vocab, key=len)]
    r = live.run(post(live, "/detokenize", {"tokens": [longest] * 500}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tokens" and "32768" in r.json()["error"]["message"]


def test_a_bad_id_deep_in_a_long_array_is_named(api) -> None:
    ids = [5] * 300_000
    ids[200_001] = "5"
    r = api.run(post(api, "/detokenize", {"tokens": ids}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[200001]", r.text
    ids[200_001] = 49152
    r = api.run(post(api, "/detokenize", {"tokens": ids, "model": api.state.model_name}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[200001]", r.text


@pytest.mark.parametrize("extra, param", [(b'"temperature": NaN', "temperature"),
                                          (b'"stop": ' + b"[" * 5000 + b"]" * 5000, None)])
def test_big_bodies_msgspec_refuses_get_json_s_answer(api, extra, param) -> None:
    """What msgspec does not parse (NaN, deep nesting) in a big body is parsed as before."""
    body = b'{"prompt": "%s", "max_tokens": 1, %s}' % (b"x " * 40_000, extra)
    r = api.run(post(api, "/v1/completions", body), timeout=30)
    assert r.status_code == 400, r.text
    assert param is None or r.json()["error"]["param"] == param


@pytest.mark.parametrize("raw, want", [
    (b"[]", []), (b" [ 1 , 2,3 ] ", [1, 2, 3]), (b"[-0, 7]", [0, 7]),
    (b"[1,2,3,4,5,6,7,8,9,10,11,12,13]", list(range(1, 14))),
    (b"[1,]", None), (b"[,1]", None), (b"[1,,2]", None), (b"[1,2,3,4,5,6,]", None),
    (b'[1,"2"]', None), (b'["1,2"]', None), (b"[1.0]", None), (b"[true]", None),
    (b"[[1,2]]", None), (b"[1e3]", None), (b"[null]", None), (b"[%d]" % (1 << 64), None),
    (b"{}", None), (b"", None), (b"1", None)])
def test_parse_ids_takes_exactly_json_integer_arrays(monkeypatch, raw, want) -> None:
    from service.api import bodies

    monkeypatch.setattr(bodies, "IDS_PIECE_BYTES", 2)  # a piece every few ids
    out = bodies.parse_ids(raw)
    assert (out is None and want is None) or (out.dtype == np.int64 and out.tolist() == want)
