"""Bad input, limits and failures: status codes and error bodies naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.api.conftest import FAULT_TOKEN, metric, wait_for


async def until(cond, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


BAD = [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompts": ["ok", ""]}, "prompts[1]", "empty"),
    ({"prompts": []}, "prompts", "at least 1"),
    ({"input_ids": []}, "input_ids", "at least 1"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]", "empty"),
    ({"input_ids": [1, -1]}, "input_ids[1]", "not a token id"),
    ({"input_ids": [[5], [1, 49152]]}, "input_ids[1][1]", "not a token id"),
    ({"input_ids": [1, "a"]}, "input_ids[1]", "valid integer"),
    ({"input_ids": [[1], [2, "a"]]}, "input_ids[1][1]", "valid integer"),
    ({"input_ids": [1, 2.5]}, "input_ids[1]", "valid integer"),
    ({"prompt": 123}, "prompt", "string"),
    ({"prompt": "a", "input_ids": [1]}, None, "exactly one of prompt, prompts or input_ids"),
    ({}, None, "exactly one of"),
    ({"prompt": "a", "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"prompt": "a", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "a", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "a", "model": "gpt-4"}, "model", "does not exist"),
]


@pytest.mark.parametrize("body,param,needle", BAD, ids=[str(b)[:40] for b, _, _ in BAD])
def test_bad_input(api, body, param, needle) -> None:
    r = api.post("/v1/prefill", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param and param.split("[")[0] in err["message"]


def test_prompt_too_long(make_app) -> None:
    live = make_app(max_prompt_tokens=8)
    r = live.post("/v1/prefill", json={"input_ids": list(range(1, 10))})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input_ids"
    assert "9 tokens" in err["message"] and "MAX_PROMPT_TOKENS" in err["message"]
    r = live.post("/v1/prefill", json={"prompt": "word " * 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_invalid_json_and_wrong_content(api) -> None:
    r = api.post("/v1/prefill", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = api.post("/v1/prefill", json=["a list"])
    assert r.status_code == 400


def test_oversized_body(make_app) -> None:
    live = make_app(max_body_bytes=2048)
    big = {"prompt": "x" * 4096}
    r = live.post("/v1/prefill", json=big)  # Content-Length says it all
    assert r.status_code == 413 and "MAX_BODY_BYTES" in r.json()["error"]["message"]

    async def streamed():  # no Content-Length: chunked upload, counted as it arrives
        async def gen():
            for _ in range(8):
                yield b"x" * 512
        return await live.client.post("/v1/prefill", content=gen(),
                                      headers={"content-type": "application/json"})

    r = live.run(streamed())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert live.post("/v1/prefill", json={"prompt": "Hi"}).status_code == 200


def test_prompt_longer_than_the_kv_pool_is_400_and_limits_say_so(make_app, core) -> None:
    """A prompt the pool can never hold is the client's error (a 503 would be retried forever),
    and /info and /v1/models advertise the limit that binds."""
    from pathlib import Path

    from service.engine.core import EngineCore
    from service.model.loader import LoadedModel
    from tests.api.conftest import configs

    loaded = LoadedModel(core.model, core.tokenizer, core.model_cfg, Path(core.model_path), 0.0)
    small = EngineCore(configs(kv_cache_bytes=4 << 20)[0], loaded=loaded)  # 80 tokens on CPU
    cap = small.pool.capacity_tokens
    assert cap < core.model_cfg.max_position_embeddings
    live = make_app(engine_factory=lambda cfg: small)
    assert live.get("/info").json()["limits"]["max_prompt_tokens"] == cap
    assert live.get("/v1/models").json()["data"][0]["max_model_len"] == cap
    r = live.post("/v1/prefill", json={"input_ids": [7] * (cap + 1)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input_ids"
    assert f"the limit is {cap} (the KV pool's capacity)" in err["message"]
    assert live.post("/v1/prefill", json={"input_ids": [7] * cap}).status_code == 200


def test_default_cpu_pool_holds_a_maximum_length_prompt(api, core) -> None:
    limit = api.get("/info").json()["limits"]["max_prompt_tokens"]
    assert limit == core.model_cfg.max_position_embeddings  # the context, not the pool, binds
    assert core.pool.capacity_tokens >= limit


def test_queue_full_is_429(make_app) -> None:
    live = make_app(max_queue_requests=2)
    live.engine.delay_s = 1.0

    async def flood():
        # two forwards in flight (the GPU's and the one launched behind it), the queue empty
        first = []
        for n, p in enumerate(("a", "a2"), 1):
            first.append(asyncio.ensure_future(live.client.post("/v1/prefill",
                                                                json={"prompt": p})))
            await until(lambda n=n: len(live.engine.forwards) == n)
        waiting = [asyncio.ensure_future(live.client.post("/v1/prefill", json={"prompt": p}))
                   for p in ("b", "c")]
        await until(lambda: live.scheduler.queue_depth == 2)
        over = await live.client.post("/v1/prefill", json={"prompt": "d"})
        return over, await asyncio.gather(*first, *waiting)

    over, done = live.run(flood())
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert "queued" in over.json()["error"]["message"]
    assert [r.status_code for r in done] == [200] * 4
    r = live.post("/v1/prefill", json={"prompts": ["a", "b", "c"]})
    assert r.status_code == 400 and "MAX_QUEUE_REQUESTS" in r.json()["error"]["message"]


def test_failing_batch_fails_only_itself(api) -> None:
    api.engine.delay_s = 0.05

    async def mixed():
        bad = asyncio.ensure_future(api.client.post(
            "/v1/prefill", json={"input_ids": [1, FAULT_TOKEN, 2]}))
        await until(lambda: api.engine.forwards)  # the bad one is in its forward; these queue
        good = [asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": p}))
                for p in ("Hello", "The capital of France is")]
        return await bad, await asyncio.gather(*good)

    bad, good = api.run(mixed())
    assert bad.status_code == 500
    assert "RuntimeError: injected fault" in bad.json()["error"]["message"]
    assert [r.status_code for r in good] == [200, 200]
    after = api.post("/v1/prefill", json={"prompt": "The capital of France is"})
    assert after.json()["results"][0]["next_token"]["text"] == " Paris"
    assert api.get("/health").status_code == 200
    assert api.scheduler.kv_used_tokens == 0
    assert metric(api.get("/metrics").text, "prefill_requests_total", status="error") == 1


def test_client_disconnect_frees_kv_pages(api, core) -> None:
    api.engine.delay_s = 1.0

    async def go():
        running = asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": "a b c"}))
        await until(lambda: api.engine.forwards)
        behind = asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": "d e"}))
        await until(lambda: len(api.engine.forwards) == 2)  # launched behind the first
        queued = asyncio.ensure_future(api.client.post(
            "/v1/prefill", json={"input_ids": [4242, 4243]}))
        await until(lambda: api.scheduler.queue_depth == 1)
        assert api.scheduler.kv_used_tokens > 0 and api.scheduler.queue_depth == 1
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        assert (await behind).status_code == 200

    api.run(go())
    # cancellations reach the engine as messages: the queue empties and the pages free soon after
    wait_for(lambda: api.scheduler.queue_depth == 0, 5, "the queued prompt dropped")
    wait_for(lambda: api.scheduler.kv_used_tokens == 0, 5, "KV pages freed")
    assert not any(4242 in ids for f in api.engine.forwards for ids in f), "cancelled prompt ran"
    metrics = api.get("/metrics").text
    assert metric(metrics, "prefill_requests_total", status="cancelled") == 2
    assert metric(metrics, "prefill_kv_used_tokens") == 0
    api.engine.delay_s = 0
    assert api.post("/v1/prefill", json={"prompt": "Hi"}).status_code == 200


def test_unexpected_error_is_a_counted_json_500(api) -> None:
    class Broken:
        def encode_within(self, text: str, limit: int, add_special: bool = True) -> list[int]:
            raise ZeroDivisionError("tokenizer exploded")

    async def call():
        transport = httpx.ASGITransport(api.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post("/v1/prefill", json={"prompt": "Hello"})

    real, api.state.tokenizer = api.state.tokenizer, Broken()
    try:
        r = api.run(call())
    finally:
        api.state.tokenizer = real
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert "ZeroDivisionError: tokenizer exploded" in r.json()["error"]["message"]
    assert metric(api.get("/metrics").text, "prefill_requests_total", status="error") == 1
    ok = api.post("/v1/prefill", json={"prompt": "The capital of France is"})
    assert ok.status_code == 200


@pytest.mark.parametrize("route", ["/v1/prefill", "/v1/completions"])
@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"temperature": 1e-45},
                                   {"temperature": 1.0, "top_p": 1e-300}])
def test_tiny_temperature_and_top_p_sample_the_greedy_token(api, route, extra) -> None:
    body = {"prompt": "The capital of France is", "seed": 3, **extra}
    r = api.post(route, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    text = (out["results"][0]["next_token"]["text"] if route == "/v1/prefill"
            else out["choices"][0]["text"])
    assert text == " Paris"


SURROGATE = "caf\ud800"


@pytest.mark.parametrize("route,body,param", [
    ("/v1/prefill", {"prompt": SURROGATE}, "prompt"),
    ("/v1/prefill", {"prompts": ["ok", SURROGATE]}, "prompts[1]"),
    ("/v1/prefill", {"prompt": "ok", "model": SURROGATE}, "model"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "ok", "model": SURROGATE}, "model"),
])
def test_lone_surrogate_is_a_400_naming_the_field_counted_once(api, route, body, param) -> None:
    content = json.dumps(body)  # ASCII JSON with a \ud800 escape: valid JSON, invalid Unicode
    r = api.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not valid Unicode" in err["message"], err
    metrics = api.get("/metrics").text
    assert metric(metrics, "prefill_requests_total", status="bad_request") == 1
    assert metric(metrics, "prefill_requests_total", status="error") == 0


def test_a_huge_model_name_is_not_echoed_in_full(api) -> None:
    r = api.post("/v1/prefill", json={"prompt": "Hi", "model": "m" * (1 << 20)})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert len(message) < 500 and "1048576 characters" in message


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_nan_sampling_values_must_be_numbers(api, field, value) -> None:
    content = f'{{"prompt": "Hi", "{field}": {value}}}'
    for route in ("/v1/prefill", "/v1/completions"):
        r = api.post(route, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "must be a number" in err["message"], err


def test_an_over_long_text_is_refused_without_tokenizing_all_of_it(api, monkeypatch) -> None:
    """A multi-megabyte prompt costs about the limit's worth of tokenizing, not its own size:
    the whole text is never handed to the tokenizer."""
    tok = api.state.tokenizer.tok
    seen: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, *a, **kw):
            seen.append(len(text))
            return tok.encode(text, *a, **kw)

        def encode_batch_fast(self, texts, *a, **kw):
            seen.extend(map(len, texts))
            return tok.encode_batch_fast(texts, *a, **kw)

        def encode_batch(self, texts, *a, **kw):
            seen.extend(map(len, texts))
            return tok.encode_batch(texts, *a, **kw)

    monkeypatch.setattr(api.state.tokenizer, "tok", Counting())
    prompt = "The quick brown fox jumps over the lazy dog. " * 45_000  # 2 MB
    r = api.post("/v1/prefill", json={"prompt": prompt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "more than 8192 tokens" in err["message"]
    assert sum(seen) < len(prompt) // 10, seen
    r = api.post("/v1/prefill", json={"prompt": "7" * 9000})  # one token per digit: exact count
    assert r.status_code == 400 and "9000 tokens; the limit is 8192" in r.json()["error"]["message"]


def test_requests_failed_at_shutdown_get_a_503_counted_as_rejected(api) -> None:
    """At the drain's end the scheduler fails what is in flight: clients get a retryable JSON
    503, and the metrics count what they saw (rejected), not a cancellation."""
    from service.engine.interface import NotReady

    api.engine.delay_s = 1.0

    async def go():
        pending = [asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": p}))
                   for p in ("Hello", "The capital of France is")]
        await until(lambda: api.engine.forwards and api.scheduler.in_flight == 2)
        assert api.scheduler.abort(NotReady("server is shutting down")) == 2
        return await asyncio.gather(*pending)

    for r in api.run(go()):
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    metrics = api.get("/metrics").text
    assert metric(metrics, "prefill_requests_total", status="rejected") == 2
    assert metric(metrics, "prefill_requests_total", status="cancelled") == 0
    wait_for(lambda: api.scheduler.kv_used_tokens == 0, 10, "pages freed")


HUGE = [1 << 63, 1 << 64, 10**30, -(1 << 63)]
# (route, the rest of a valid body, the integer field, where it sits)
INTEGER_FIELDS = [
    ("/v1/prefill", {"prompt": "a"}, "top_k", lambda v: {"top_k": v}),
    ("/v1/prefill", {"prompt": "a"}, "seed", lambda v: {"seed": v}),
    ("/v1/prefill", {}, "input_ids[1]", lambda v: {"input_ids": [1, v]}),
    ("/v1/prefill", {"prompt": "a"}, "logprob_token_ids[0]",
     lambda v: {"logprob_token_ids": [v]}),
    ("/v1/completions", {"prompt": "a"}, "top_k", lambda v: {"top_k": v}),
    ("/v1/completions", {}, "prompt[0]", lambda v: {"prompt": [v]}),
    ("/v1/completions", {"prompt": "a"}, "max_tokens", lambda v: {"max_tokens": v}),
    ("/v1/completions", {"prompt": "a"}, "n", lambda v: {"n": v}),
    ("/v1/score", {"items": [[1]], "label_token_ids": [1]}, "query[0]",
     lambda v: {"query": [v]}),
    ("/v1/score", {"query": [1], "label_token_ids": [1]}, "items[0][0]",
     lambda v: {"items": [[v]]}),
    ("/v1/score", {"query": "a", "items": ["b"]}, "label_token_ids[0]",
     lambda v: {"label_token_ids": [v]}),
]


@pytest.mark.parametrize("route,base,param,body", INTEGER_FIELDS,
                         ids=[f"{r}:{p}" for r, _, p, _ in INTEGER_FIELDS])
def test_integers_beyond_any_wire_type_are_a_400(api, route, base, param, body) -> None:
    """An integer that no message to the engine could carry is refused where it enters, naming
    the field: never a 500 from the engine boundary."""
    for v in HUGE:
        r = api.post(route, json={**base, **body(v)})
        assert r.status_code == 400, (v, r.text)
        assert r.json()["error"]["param"] == param, (v, r.text)


def test_a_request_the_engine_drops_is_a_json_503(api) -> None:
    """A Cancel not from the request's worker drops it in the engine; the client gets a JSON
    503 with Retry-After (not a 500, not silence)."""
    import zmq

    from service.engine import messages as m

    async def forged() -> httpx.Response:
        api.engine.delay_s = 0.5
        pending = asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": "Hi"}))
        await until(lambda: api.engine_thread.server.requests)
        (worker, rid), = list(api.engine_thread.server.requests)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(api.engine_thread.addrs.inbox)
        push.send(m.encode(m.Cancel(worker, [rid])))
        push.close(linger=1000)
        return await pending

    r = api.run(forged())
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "cancelled" in r.json()["error"]["message"]


def test_a_request_past_request_timeout_is_a_json_504(make_app) -> None:
    """An engine that stops answering holds no request past REQUEST_TIMEOUT_S."""
    live = make_app(request_timeout_s=0.5)
    live.engine_thread.silence()
    r = live.post("/v1/prefill", json={"prompt": "Hi"})
    assert r.status_code == 504, r.text
    assert "REQUEST_TIMEOUT_S" in r.json()["error"]["message"]


@pytest.mark.parametrize("route,body,param", [
    ("/v1/prefill", {"prompt": "a", "zz_unknown": "X"}, "zz_unknown[0][0][0]"),
    ("/v1/completions", {"prompt": "X"}, "prompt[0][0][0]"),
    ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [5], "x": {"y": "X"}},
     "x.y[0][0]"),
])
def test_a_body_nested_past_the_json_parser_is_a_400_naming_where(api, route, body, param) -> None:
    raw = json.dumps(body).replace('"X"', "[" * 100_000 + "]" * 100_000)
    r = api.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and "more than 128 levels deep" in err["message"], err
