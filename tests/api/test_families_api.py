"""Each model family served by the app (MODEL_PATH a tiny checkpoint, the real EngineCore)
answers /v1/score, /v1/completions and /v1/prefill with transformers' numbers; token-id prompts
keep the tokenizer out of the comparison."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from service.engine.core import EngineCore
from service.model.files import model_tokenizer
from tests.api.conftest import LiveApp, start_app
from tests.engine.helpers import prompts
from tests.model.checkpoints import write_checkpoint

ATOL = 1e-4
K = 5  # top logprobs asked for
VOCAB = 384
NAMED = list(range(1, VOCAB, 3))  # logprob_token_ids: a third of the vocabulary
BUDGET = 32  # MAX_PREFILL_TOKENS: the longer prompts are prefilled in chunks


class Served(NamedTuple):
    app: LiveApp
    ref: torch.nn.Module  # transformers' model of the checkpoint


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def served(request, tmp_path_factory):
    import transformers

    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    app = start_app(EngineCore, model_tokenizer(str(path)), model_path=str(path), device="cpu",
                    dtype="float32", page_size=4, prefix_cache="true",
                    max_prefill_tokens=BUDGET)
    try:
        app.wait_ready()
        assert app.scheduler.info.architecture == request.param
        yield Served(app, ref)
        assert app.scheduler.kv_used_tokens == 0, "a request kept its KV pages"
    finally:
        app.close()


def post(app: LiveApp, path: str, **body) -> dict:
    r = app.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    """(n, vocab): row i is transformers' log-distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=ATOL, rtol=0)


def same_top(got: dict[int, float], row: torch.Tensor) -> None:
    """K alternatives {id: logprob}: each its own logprob, together the top K's."""
    assert len(got) == K
    close(list(got.values()), row[list(got)])
    close(sorted(got.values(), reverse=True), row.topk(K).values)


@pytest.mark.parametrize("query_len", [12, 202])  # whole prompts; a query prefilled once
def test_score_matches_transformers(served, query_len: int) -> None:
    """Each item's label scores are its label tokens' probabilities after query + item."""
    query, *items = prompts(VOCAB, [query_len, 3, 1, 9, 6], seed=21 + query_len)
    labels = [2, 77, 150, 383]
    out = post(served.app, "/v1/score", query=query, items=items, label_token_ids=labels)
    assert len(out["scores"]) == len(items)
    for item, scores in zip(items, out["scores"]):
        want = ref_logprobs(served.ref, query + item)[-1, labels]
        close([math.log(s) for s in scores], want)
    shared = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    if query_len > 200:  # 202 x 3 tokens saved: over MIN_SAVED_TOKENS
        assert shared == len(items) * query_len


def test_completions_prompt_logprobs_match_transformers(served) -> None:
    """vLLM's prompt_logprobs (keyed by token id, with rank) and the first token's logprobs."""
    (ids,) = prompts(VOCAB, [43], seed=31)
    out = post(served.app, "/v1/completions", prompt=ids, max_tokens=1, logprobs=K,
               prompt_logprobs=K, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    lp = ref_logprobs(served.ref, ids)
    plps = choice["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for i, entry in enumerate(plps[1:]):
        row, own = lp[i], ids[i + 1]
        got = {int(t): v for t, v in entry.items()}
        close([got[own]["logprob"]], row[[own]])
        assert got[own]["rank"] == int((row > row[own]).sum()) + 1
        top = {t: v["logprob"] for t, v in got.items() if v["rank"] <= K}
        if got[own]["rank"] > K:
            top.pop(own, None)
        same_top(top, row)
    first = choice["logprobs"]
    assert first["tokens"] == [f"token_id:{int(lp[-1].argmax())}"]
    close(first["token_logprobs"], lp[-1].max().reshape(1))
    same_top({int(t.split(":")[1]): v for t, v in first["top_logprobs"][0].items()}, lp[-1])


def check_result(res: dict, ids: list[int], ref, prompt_logprobs: bool) -> None:
    lp = ref_logprobs(ref, ids)
    assert res["prompt_tokens"] == len(ids)
    assert res["next_token"]["id"] == int(lp[-1].argmax())
    close([res["next_token"]["logprob"]], lp[-1].max().reshape(1))
    same_top({t["id"]: t["logprob"] for t in res["top_logprobs"]}, lp[-1])
    close([t["logprob"] for t in res["token_logprobs"]], lp[-1, NAMED])
    if not prompt_logprobs:
        assert res["prompt_logprobs"] is None
        return
    plps = res["prompt_logprobs"]
    assert [p["id"] for p in plps] == ids and plps[0]["logprob"] is None
    for p, row in zip(plps[1:], lp):
        close([p["logprob"]], row[[p["id"]]])
        same_top({t["id"]: t["logprob"] for t in p["top_logprobs"]}, row)
        close([t["logprob"] for t in p["token_logprobs"]], row[NAMED])


def test_prefill_matches_transformers_then_over_the_prefix_cache(served) -> None:
    """Two prompts with prompt logprobs (chunked by the 32-token budget), then a prompt that
    shares 38 tokens with the first and reads its 9 full pages from the prefix cache."""
    first, other, tail = prompts(VOCAB, [45, 37, 10], seed=41)
    body = dict(top_logprobs=K, logprob_token_ids=NAMED)
    out = post(served.app, "/v1/prefill", input_ids=[first, other], prompt_logprobs=True, **body)
    for res, ids in zip(out["results"], [first, other]):
        check_result(res, ids, served.ref, prompt_logprobs=True)
    again = first[:38] + tail
    res = post(served.app, "/v1/prefill", input_ids=again, **body)["results"][0]
    assert res["cached_tokens"] == 36
    check_result(res, again, served.ref, prompt_logprobs=False)


def test_info_reports_kv_bytes_per_token_and_the_windowed_share(served) -> None:
    """The tiny checkpoints in fp32: 2 KV heads x 32 dims x K and V x 4 bytes a layer; Qwen3's
    3 layers, Gemma 3's 6 of which 4 are windowed."""
    kv = served.app.get("/info").json()["kv"]
    layer = 2 * 32 * 2 * 4
    layers, windowed = (6, 4) if served.app.scheduler.info.architecture == "gemma3" else (3, 0)
    assert kv["bytes_per_token"] == layers * layer
    assert kv["windowed_layers_bytes_per_token"] == windowed * layer
