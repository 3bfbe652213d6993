"""Bad input, limits and failures: status codes and error bodies naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.api.conftest import FAULT_TOKEN, wait_for


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
    ({"prompt": "a", "max_tokens": 5}, "max_tokens", "Extra inputs are not permitted"),
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


def test_never_fits_kv_pool_is_503(api, core) -> None:
    cap = core.pool.capacity_tokens
    r = api.post("/v1/prefill", json={"input_ids": [7] * (cap + 1)})
    assert r.status_code == 503 and "KV pages" in r.json()["error"]["message"]


def test_queue_full_is_429(make_app) -> None:
    live = make_app(max_queue_requests=2)
    live.engine.delay_s = 1.0

    async def flood():
        first = asyncio.ensure_future(live.client.post("/v1/prefill", json={"prompt": "a"}))
        await until(lambda: live.engine.forwards)  # running now, queue empty
        waiting = [asyncio.ensure_future(live.client.post("/v1/prefill", json={"prompt": p}))
                   for p in ("b", "c")]
        await until(lambda: live.state.scheduler.queue_depth == 2)
        over = await live.client.post("/v1/prefill", json={"prompt": "d"})
        return over, await asyncio.gather(first, *waiting)

    over, done = live.run(flood())
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert "queued" in over.json()["error"]["message"]
    assert [r.status_code for r in done] == [200, 200, 200]
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
    assert api.state.scheduler.kv_used_tokens == 0
    assert 'prefill_requests_total{status="error"} 1.0' in api.get("/metrics").text


def test_client_disconnect_frees_kv_pages(api, core) -> None:
    api.engine.delay_s = 1.0

    async def go():
        running = asyncio.ensure_future(api.client.post("/v1/prefill", json={"prompt": "a b c"}))
        await until(lambda: api.engine.forwards)
        queued = asyncio.ensure_future(api.client.post(
            "/v1/prefill", json={"input_ids": [4242, 4243]}))
        await until(lambda: api.state.scheduler.queue_depth == 1)
        assert api.state.scheduler.kv_used_tokens > 0 and api.state.scheduler.queue_depth == 1
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)

    api.run(go())
    assert api.state.scheduler.queue_depth == 0
    wait_for(lambda: api.state.scheduler.kv_used_tokens == 0, 5, "KV pages freed")
    assert not any(4242 in ids for f in api.engine.forwards for ids in f), "cancelled prompt ran"
    metrics = api.get("/metrics").text
    assert 'prefill_requests_total{status="cancelled"} 2.0' in metrics
    assert "prefill_kv_used_tokens 0.0" in metrics
    api.engine.delay_s = 0
    assert api.post("/v1/prefill", json={"prompt": "Hi"}).status_code == 200


def test_unexpected_error_is_a_counted_json_500(api) -> None:
    class Broken:
        def encode(self, text: str) -> list[int]:
            raise ZeroDivisionError("tokenizer exploded")

    async def call():
        transport = httpx.ASGITransport(api.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post("/v1/prefill", json={"prompt": "Hello"})

    api.engine.tokenizer = Broken()  # the proxy's own attribute shadows the real tokenizer
    try:
        r = api.run(call())
    finally:
        del api.engine.tokenizer
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert "ZeroDivisionError: tokenizer exploded" in r.json()["error"]["message"]
    assert 'prefill_requests_total{status="error"} 1.0' in api.get("/metrics").text
    ok = api.post("/v1/prefill", json={"prompt": "The capital of France is"})
    assert ok.status_code == 200
