"""/health, /ready, /info, /v1/models; loading and a failed load."""

from __future__ import annotations

import threading

from service.model.files import default_model_path
from tests.api.conftest import TestEngine, metric, wait_for


def test_ready_app_endpoints(api) -> None:
    assert api.get("/health").json() == {"status": "ok", "state": "ready"}
    assert api.get("/ready").status_code == 200
    info = api.get("/info").json()
    assert info["state"] == "ready" and info["device"] == "cpu" and info["dtype"] == "float32"
    # the served name, not where the model lies: /info needs no API key
    assert info["model"] == "SmolLM2-135M-Instruct.Q4_1"
    text = api.get("/info").text
    assert str(default_model_path().parent) not in text and ".gguf" not in text
    assert info["graph"]["enabled"] is False
    assert info["graph"]["full_buckets"] == [] and info["graph"]["full_max_seqs"] == 8
    assert info["full_graph_forwards"] == 0
    mem = info["memory"]
    for key in ("weights_bytes", "capture_bytes", "retained_input_bytes", "kv_bytes", "kv_tokens",
                "mem_fraction_static", "free_before_bytes", "reserve_bytes"):
        assert key in mem, key
    assert mem["weights_bytes"] > 0 and mem["kv_tokens"] == info["kv"]["capacity_tokens"] > 0
    assert info["kv"]["bytes_per_token"] * mem["kv_tokens"] <= mem["kv_bytes"]
    assert info["kv"]["windowed_layers_bytes_per_token"] == 0
    assert info["load_seconds"] >= 0
    models = api.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == info["limits"]["max_prompt_tokens"] == 8192


def test_health_answers_while_loading(make_app, core) -> None:
    release = threading.Event()

    def slow_factory(cfg):
        release.wait(30)
        return TestEngine(core)

    live = make_app(engine_factory=slow_factory, wait=False)
    try:
        assert live.get("/health").json() == {"status": "ok", "state": "loading"}
        r = live.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "loading"
        assert live.get("/info").json()["state"] == "loading"
        r = live.post("/v1/prefill", json={"prompt": "Hi"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        assert live.get("/v1/models").status_code == 503
        metrics = live.get("/metrics").text
        assert metric(metrics, "prefill_ready") == 0
    finally:
        release.set()
    live.wait_ready()
    assert metric(live.get("/metrics").text, "prefill_ready") == 1


def test_failed_load_reports_dead(make_app) -> None:
    def broken(cfg):
        raise FileNotFoundError("no weights at /nowhere")

    live = make_app(engine_factory=broken, wait=False)
    wait_for(lambda: live.get("/health").status_code == 503, 10, "/health 503")
    body = live.get("/health").json()
    assert body["state"] == "failed" and "no weights at /nowhere" in body["error"]
    assert live.get("/ready").status_code == 503
    r = live.post("/v1/prefill", json={"prompt": "Hi"})
    assert r.status_code == 503 and "no weights" in r.json()["error"]["message"]
    assert "FileNotFoundError" in r.json()["error"]["message"]


def test_a_dead_engine_fails_health_ready_and_what_is_in_flight_at_once(make_app) -> None:
    """The engine process's end of the alive pipe closes when it dies: no request waits for an
    answer that cannot come, and no probe stays green."""
    live = make_app()
    live.engine.delay_s = 2.0  # the request below is in a forward when the engine dies
    pending = live.submit(live.client.post("/v1/prefill", json={"prompt": "Hello"}))
    wait_for(lambda: live.scheduler.running == 1, 10, "the request to run")
    live.kill_engine()
    r = pending.result(5)
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert "engine process is gone" in r.json()["error"]["message"]
    health = live.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "dead"
    assert live.get("/ready").status_code == 503
    r = live.post("/v1/prefill", json={"prompt": "Hi"})
    assert r.status_code == 503 and "gone" in r.json()["error"]["message"]
    assert metric(live.get("/metrics").text, "prefill_ready") == 0
