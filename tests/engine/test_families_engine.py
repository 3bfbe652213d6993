"""Each model family through the real EngineCore and Scheduler equals transformers (fp32, same
checkpoint): first-token and prompt logprobs in one forward, split by a small token budget, and
over a prefix-cache hit."""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from typing import NamedTuple

import pytest
import torch

from service.engine.core import EngineCore
from service.engine.interface import PositionLogprobs, PromptResult, SamplingParams
from service.engine.prompt import Prompt
from service.engine.scheduler import Scheduler
from tests.engine.helpers import engine_cfg, prompts
from tests.model.checkpoints import write_checkpoint

ATOL = 1e-4
K = 5  # top logprobs asked for
NAMED = tuple(range(0, 384, 3))  # a third of the vocabulary, whatever its rank
BUDGETS = {"whole": 128, "chunked": 16}  # MAX_PREFILL_TOKENS of each engine


class Served(NamedTuple):
    ref: torch.nn.Module  # transformers' model of the checkpoint
    schedulers: dict[str, Scheduler]  # by BUDGETS' keys, prefix cache on


def _started(core: EngineCore) -> Scheduler:
    s = Scheduler(lambda: core, max_queue=16, max_batch_prompts=8, prefix_cache=True)
    loaded = threading.Event()
    s.start(lambda exc: loaded.set())
    assert loaded.wait(30) and s.state == "ready", s.error
    return s


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def served(request, tmp_path_factory):
    import transformers

    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cores = {k: EngineCore(engine_cfg(model_path=str(path), max_prefill_tokens=n))
             for k, n in BUDGETS.items()}
    assert all(c.model_cfg.arch == request.param for c in cores.values())
    scheds = {k: _started(c) for k, c in cores.items()}
    yield Served(ref, scheds)
    for k, s in scheds.items():
        s.stop(10.0)
        assert cores[k].pool.used_tokens == 0, "a test leaked KV pages"


def _submit(s: Scheduler, ids_list: list[list[int]], **params) -> list[PromptResult]:
    """Queue the prompts together; their results, in order."""
    futs: list[Future] = [Future() for _ in ids_list]

    def done(fut: Future):
        return lambda res, exc: fut.set_exception(exc) if exc else fut.set_result(res)

    s.submit([Prompt(ids, SamplingParams(**params), done(f)) for ids, f in zip(ids_list, futs)])
    return [f.result(timeout=30) for f in futs]


def _ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    """(n, vocab): row i is transformers' log-distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=ATOL, rtol=0)


def _same_position(p: PositionLogprobs, row: torch.Tensor, token: int) -> None:
    """One position's token logprob, top K (ids may swap only within a tie) and named tokens."""
    assert p.token.id == token
    _close([p.token.logprob], row[[token]])
    _close([t.logprob for t in p.top], row.topk(K).values)
    _close([t.logprob for t in p.top], row[[t.id for t in p.top]])
    _close(p.named, row[list(NAMED)])


def _matches(res: PromptResult, ids: list[int], ref, prompt_logprobs: bool) -> None:
    lp = _ref_logprobs(ref, ids)
    assert res.prompt_tokens == len(ids)
    _same_position(res.next, lp[-1], int(lp[-1].argmax()))
    if not prompt_logprobs:
        assert res.prompt_logprobs is None
        return
    assert len(res.prompt_logprobs) == len(ids) - 1
    for i, p in enumerate(res.prompt_logprobs):
        _same_position(p, lp[i], ids[i + 1])
        assert p.rank == int((lp[i] > lp[i, ids[i + 1]]).sum()) + 1


@pytest.mark.parametrize("budget", BUDGETS)
def test_logprobs_match_transformers(served, budget: str) -> None:
    """Two prompts queued together: in one forward, or split into 16-token chunks (the second
    prompt's start at 3, 19, 35, mid-page and across Gemma 3's 8-token window)."""
    s = served.schedulers[budget]
    ids = prompts(384, [45, 37], seed=11)
    forwards = sum(s.engine.forward_counts.values())
    out = _submit(s, ids, prompt_logprobs=True, top_logprobs=K, logprob_token_ids=NAMED)
    ran = sum(s.engine.forward_counts.values()) - forwards
    assert ran == math.ceil(sum(map(len, ids)) / BUDGETS[budget])
    for res, p in zip(out, ids):
        assert res.cached_tokens == 0  # prompt logprobs need every position computed
        _matches(res, p, served.ref, prompt_logprobs=True)


@pytest.mark.parametrize("budget", BUDGETS)
def test_prefix_cache_hit_matches_transformers(served, budget: str) -> None:
    """A prompt sharing 38 tokens with an earlier one reads its 9 full pages from the prefix
    cache and computes the rest on top of them (Gemma 3: windows reaching into the cache)."""
    s = served.schedulers[budget]
    first, tail = prompts(384, [44, 12], seed=12)  # each budget's engine has its own cache
    second = first[:38] + tail
    params = dict(top_logprobs=K, logprob_token_ids=NAMED)
    (a,) = _submit(s, [first], **params)
    (b,) = _submit(s, [second], **params)
    assert a.cached_tokens == 0 and b.cached_tokens == 36
    _matches(a, first, served.ref, prompt_logprobs=False)
    _matches(b, second, served.ref, prompt_logprobs=False)
