"""A route defined outside service/ is served by the real app through create_app's `routers`,
with the shared layer's policies (API key, body fields, model check, tokenizing) applied."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from service.api.app import ROUTERS
from service.api.deps import State, require_api_key
from service.api.prompts import encode_texts, tokenized
from service.api.schemas import Body, Text

router = APIRouter(prefix="/v1", tags=["echo"], dependencies=[Depends(require_api_key)])


class EchoRequest(Body):
    model: Text | None = None
    text: Text


@router.post("/echo-tokens")
async def echo_tokens(body: EchoRequest, state: State, request: Request) -> dict:
    (ids,) = await tokenized(state, request, body.model, encode_texts, state, [body.text],
                             "text", True)
    return {"model": state.model_name, "tokens": ids}


def test_a_route_module_outside_service_is_served(make_app) -> None:
    api = make_app(routers=(*ROUTERS, router), api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert api.post("/v1/echo-tokens", json={"text": "Paris"}).status_code == 401

    r = api.post("/v1/echo-tokens", json={"text": "The capital of France is"}, headers=auth)
    expected = api.post("/tokenize", json={"prompt": "The capital of France is"}, headers=auth)
    assert r.status_code == 200 and expected.status_code == 200, (r.text, expected.text)
    assert r.json()["tokens"] == expected.json()["tokens"]

    refused = {"text": "a", "guided_json": {"type": "object"}}
    for body, status, param in (({"text": ""}, 400, "text"), (refused, 400, "guided_json"),
                                ({"text": "a", "model": "other"}, 404, "model")):
        r = api.post("/v1/echo-tokens", json=body, headers=auth)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
