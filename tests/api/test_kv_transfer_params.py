"""`kv_transfer_params` on the OpenAI routes and /v1/prefill: llm-d's prefill request answered
as vLLM's prefill answers it (KV_TRANSFER=nixl; NIXL replaced by tests/kv_transfer's fake
agent), refused where it cannot be honoured, ignored without KV_TRANSFER."""

from __future__ import annotations

import pytest

from service.kv_transfer import producer as producer_mod
from tests.api.conftest import free_port, metric
from tests.kv_transfer.test_producer import VLLM_FIELDS, FakeAgent

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# what llm-d's routing sidecar sends the prefill pod (its prefill request: max_tokens 1)
SIDECAR = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture
def nixl_app(make_app, monkeypatch):
    monkeypatch.setattr(producer_mod, "NixlAgent", FakeAgent)
    return make_app(kv_transfer="nixl", kv_transfer_port=free_port(),
                    kv_transfer_engine_id="prefill-api")


def test_completions_chat_and_prefill_answer_vllms_kv_transfer_params(nixl_app):
    r = nixl_app.post("/v1/completions", json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "stream": False,
        "kv_transfer_params": SIDECAR})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer_params"]
    assert list(kv) == VLLM_FIELDS and kv["remote_engine_id"].startswith("prefill-api-")
    assert kv["remote_num_tokens"] == r.json()["usage"]["prompt_tokens"]
    chat = nixl_app.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "kv_transfer_params": SIDECAR}).json()["kv_transfer_params"]
    assert chat["remote_request_id"] != kv["remote_request_id"]
    native = nixl_app.post("/v1/prefill", json={"prompts": ["a b", "c d e"],
                                                "kv_transfer_params": SIDECAR}).json()
    offers = [kv, chat] + [x["kv_transfer_params"] for x in native["results"]]
    assert [o["remote_num_tokens"] for o in offers[2:]] == [
        x["prompt_tokens"] for x in native["results"]]
    text = nixl_app.get("/metrics").text
    assert metric(text, "prefill_kv_transfer_offered_requests_total") == 4
    assert metric(text, "prefill_kv_transfer_leased_pages") == sum(
        len(o["remote_block_ids"][0]) for o in offers)
    plain = nixl_app.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "max_tokens": 1}).json()
    assert plain["kv_transfer_params"] is None  # not asked for


@pytest.mark.parametrize("body, field", [
    ({"prompt": ["a", "b"], "kv_transfer_params": SIDECAR}, "kv_transfer_params"),
    ({"prompt": "a", "kv_transfer_params": {"do_remote_decode": "yes"}}, "kv_transfer_params"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(nixl_app, body, field):
    r = nixl_app.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400 and field in r.text, r.text


def test_without_kv_transfer_the_params_are_ignored_as_by_vllm(api):
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1,
                                          "kv_transfer_params": SIDECAR})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
