"""A deadline or a client gone stops the engine's work on a long prompt: the CPU engine reaches a
chunk boundary within about a second, drops the prompt and serves the next request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.api.conftest import metric, wait_for

pytestmark = pytest.mark.slow

LONG = 8000  # tokens: one forward of them takes minutes on a CPU


def long_ids(seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 49000 + 10 for i in range(LONG)]


def assert_engine_freed(get) -> None:  # noqa: ANN001 - a path -> httpx.Response
    """A short request is answered at once, and the long prompt no longer runs."""
    t0 = time.monotonic()
    short = get("/v1/prefill", {"input_ids": [1, 2, 3]})
    assert short.status_code == 200, short.text
    assert time.monotonic() - t0 < 10, "the short request waited for the abandoned prompt"
    wait_for(lambda: metric(get("/metrics").text, "prefill_running_requests") == 0, 5,
             "the abandoned prompt to stop running")


def test_a_deadline_stops_the_long_prompt(make_app) -> None:
    live = make_app(request_timeout_s=5)
    t0 = time.monotonic()
    r = live.post("/v1/prefill", json={"input_ids": long_ids(0)})
    assert r.status_code == 504 and r.json()["error"]
    assert time.monotonic() - t0 < 9
    assert_engine_freed(lambda path, body=None: live.post(path, json=body) if body
                        else live.get(path))


def test_a_client_gone_stops_the_long_prompt(served) -> None:
    url = served()
    gone = threading.Event()

    def go() -> None:
        try:
            httpx.post(url + "/v1/prefill", json={"input_ids": long_ids(1)}, timeout=3)
        except httpx.TimeoutException:
            gone.set()

    threading.Thread(target=go, daemon=True).start()
    wait_for(gone.is_set, 10, "the client to give up")
    with httpx.Client(base_url=url, timeout=30) as c:
        assert_engine_freed(lambda path, body=None: c.post(path, json=body) if body
                            else c.get(path))
