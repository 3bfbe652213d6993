"""API_KEY: POST and /v1 endpoints need the bearer token; health, readiness, metrics stay open."""

from __future__ import annotations

import pytest

from tests.api.conftest import metric


@pytest.fixture
def secured(make_app):
    return make_app(api_key="s3cret")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "s3cret"},
                                     {"Authorization": "Basic s3cret"}])
def test_401_without_valid_key(secured, headers) -> None:
    for path, body in (("/v1/prefill", {"prompt": "Hi"}),
                       ("/v1/completions", {"model": "x", "prompt": "Hi"})):
        r = secured.post(path, json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert secured.get("/v1/models", headers=headers).status_code == 401


def test_open_endpoints_and_valid_key(secured) -> None:
    for path in ("/health", "/ready", "/metrics", "/info"):
        assert secured.get(path).status_code == 200, path
    ok = {"Authorization": "Bearer s3cret"}
    r = secured.post("/v1/prefill", json={"prompt": "Hi"}, headers=ok)
    assert r.status_code == 200
    assert secured.get("/v1/models", headers=ok).status_code == 200
    secured.post("/v1/prefill", json={"prompt": "Hi"})
    assert metric(secured.get("/metrics").text, "prefill_requests_total",
                  status="unauthorized") == 1


def test_no_key_configured_is_open(api) -> None:
    assert api.post("/v1/prefill", json={"prompt": "Hi"}).status_code == 200
