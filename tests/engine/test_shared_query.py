"""Prompts over a shared query: the query is prefilled once, each prompt reads its KV through
its page table, and every prompt answers as if prefilled alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from service.engine.core import EngineCore
from service.engine.interface import SamplingParams
from service.engine.pages import common_prefix
from service.engine.prompt import shared_query
from service.engine.scheduler import Scheduler
from tests.engine.helpers import PAGE, engine_cfg, prompts, tiny_loaded
from tests.engine.test_scheduler import FakeEngine, run, settled, start, started, until

LABELS = (3, 50, 96, 0)


def group(ids: list[list[int]], shared: int, params: SamplingParams):
    """shared_query's prompts, with futures for the items' results and the query's failure."""
    items = [settled() for _ in ids]
    query = settled()
    ps = shared_query([np.asarray(i, dtype=np.int64) for i in ids], shared, params,
                      [cb for _, cb in items], query[1])
    return ps, [f for f, _ in items], query[0]


class Recording:
    """The real core, with the token count of every forward it launched."""

    def __init__(self, core: EngineCore):
        self.core, self.tokens = core, []

    def __getattr__(self, name):
        return getattr(self.core, name)

    def launch(self, chunks):
        self.tokens.append(sum(c.num_tokens for c in chunks))
        return self.core.launch(chunks)


@pytest.mark.parametrize("query_len", [90, 88])  # a part-filled last page, and none
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_items_score_as_if_prefilled_alone(query_len: int, prefix_cache: bool) -> None:
    core = EngineCore(engine_cfg(max_prefill_tokens=64), loaded=tiny_loaded())
    vocab = core.model_cfg.vocab_size
    lengths = [3, 1, 7, 12, 5, 2, 9, 4, 6, 8]
    query, *items = prompts(vocab, [query_len, *lengths], seed=3)
    full = [query + it for it in items]
    rec = Recording(core)

    async def main():
        s = Scheduler(lambda: rec, max_queue=64, max_batch_prompts=4, prefix_cache=prefix_cache)
        await start(s)
        ps, futs, qfut = group(full, query_len, SamplingParams(logprob_token_ids=LABELS))
        s.submit(ps)
        out = await asyncio.gather(*futs)
        assert (await qfut).prompt_tokens == query_len
        assert s.kv_used_tokens == 0, "pages held after every item finished"
        s.stop()
        return out

    out = run(main())
    assert core.pool.used_tokens == 0
    # the query once (in two chunks: the budget is 64), then the items' own tokens
    assert sum(rec.tokens) == query_len + sum(lengths)
    assert len(rec.tokens) >= 2 + len(items) // 4
    for ids, res in zip(full, out):
        ref = torch.log_softmax(core.prefill_chunked(ids).float(), -1)
        assert res.prompt_tokens == len(ids) and res.cached_tokens == query_len
        assert res.next.token.id == int(ref.argmax())
        torch.testing.assert_close(torch.tensor(res.next.named), ref[list(LABELS)], atol=1e-4,
                                   rtol=0)


def test_items_wait_for_the_query_and_its_pages() -> None:
    """A pool too small for every item at once: items are admitted as pages free up, each
    after the forward that writes the query, with the query's part-filled page copied."""
    async def main():
        eng = FakeEngine(pages=10, page_size=4, budget=64)
        s = await started(eng, max_batch_prompts=2)
        query = list(range(1, 15))  # 14 tokens: 3 full pages + 2 tokens
        full = [query + [20 + i, 30 + i, 40 + i] for i in range(6)]  # 17 tokens: 5 pages
        ps, futs, _ = group(full, 14, SamplingParams())
        s.submit(ps)
        out = await asyncio.gather(*futs)
        assert [o.next.token.id for o in out] == [41 + i for i in range(6)]
        qchunk = eng.calls[0][0]
        assert qchunk.token_ids == tuple(query) and len(eng.calls[0]) == 1
        for call in eng.calls[1:]:
            for c in call:
                assert c.prefix_len == 14 and c.num_tokens == 3
                assert c.pages[:3] == qchunk.pages[:3]
        for n, call in enumerate(eng.calls[1:], 1):
            # each item's own copy of the query's page 4, made just before its forward
            made = {d: s for at, src, dst in eng.pool.copies if at == n for s, d in zip(src, dst)}
            assert {made.get(c.pages[3]) for c in call} == {qchunk.pages[3]}
        assert s.kv_used_tokens == 0
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())


def test_cancel_mid_group_frees_every_page() -> None:
    async def main():
        eng = FakeEngine(pages=16, page_size=4, budget=64)
        eng.free_run = False
        s = await started(eng, max_batch_prompts=2)
        query = list(range(1, 11))
        ps, futs, _ = group([query + [50 + i] for i in range(5)], 10, SamplingParams())
        s.submit(ps)
        await until(lambda: len(eng.calls) == 1, "the query's forward")
        eng.permits.release()
        await until(lambda: len(eng.calls) == 2, "the first items' forward")
        for p in ps:
            s.cancel(p)
        for _ in range(3):
            eng.permits.release()
        await until(lambda: s.running == 0 and s.queue_depth == 0, "the group gone")
        await until(lambda: s.kv_used_tokens == 0, "the query's pages freed")
        assert not any(f.done() for f in futs)
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())


def test_a_failed_query_answers_for_its_items() -> None:
    async def main():
        eng = FakeEngine(pages=16, page_size=4, budget=64)
        eng.fail_token = 7
        s = await started(eng)
        ps, futs, qfut = group([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(3)], 9,
                               SamplingParams())
        s.submit(ps)
        with pytest.raises(Exception, match="forward failed"):
            await qfut
        eng.fail_token = None
        after = [1, 2]  # the engine goes on: the items are dropped, their pages free
        from tests.engine.test_scheduler import req
        r = req(after)
        s.submit([r])
        await r.future
        assert not any(f.done() for f in futs)
        assert s.kv_used_tokens == 0 and s.queue_depth == 0
        s.stop()
        assert eng.pool.used_tokens == 0

    run(main())


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4, 5])
    assert common_prefix([a, np.array([1, 2, 3, 9]), np.array([1, 2, 3, 4, 5, 6])]) == 3
    assert common_prefix([a, a[:2]]) == 2
    assert common_prefix([a, np.array([7])]) == 0
    assert PAGE == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_query_on_the_gpu_equals_single_prompts() -> None:
    """Through full graphs, breakable graphs and a query split over forwards (bf16): every
    item's label logprobs and first token equal those of its prompt prefilled alone."""
    import threading

    from service.model.families import preset
    from service.model.loader import LoadedModel, random_model

    cfg = preset("smollm2-135m", num_layers=4)
    loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16, seed=5), None, cfg,
                         "random", 0.0)
    core = EngineCore(engine_cfg(device="cuda", dtype="bfloat16", mem_fraction_static=0.3,
                                 max_prefill_tokens=2048, cuda_graph_max_tokens=2048,
                                 page_size=16, max_batch_prompts=64), loaded=loaded)
    labels = tuple(range(100, 116))
    params = SamplingParams(logprob_token_ids=labels)
    sched = Scheduler(lambda: core, max_queue=1000, max_batch_prompts=64)
    ready = threading.Event()
    sched.start(lambda exc: ready.set())
    assert ready.wait(120) and sched.state == "ready"
    # (query, items, item tokens): full graphs with a copied page; breakable; a split query
    cases = [(37, 6, 5), (1000, 64, 20), (3001, 20, 9)]
    groups = []
    for q, n, length in cases:
        query, *items = prompts(cfg.vocab_size, [q] + [length] * n, seed=q)
        full = [np.asarray(query + it) for it in items]
        out: dict[int, object] = {}
        done = threading.Event()

        def on(i, res, exc, out=out, done=done, n=n):
            out[i] = exc or res
            if len(out) == n or exc is not None:
                done.set()
        ps = shared_query(full, q, params,
                          [lambda r, e, i=i, on=on: on(i, r, e) for i in range(n)],
                          lambda r, e, on=on: e and on(-1, None, e))
        sched.submit(ps)
        groups.append((full, out, done))
    for _, out, done in groups:
        assert done.wait(120) and -1 not in out, out.get(-1)
    assert core.runs["full"] and core.runs["breakable"]
    for full, out, _ in groups:
        for i, ids in enumerate(full):
            alone = torch.log_softmax(core.prefill_chunked(ids.tolist()).float(), -1).cpu()
            got = out[i]
            # bf16 sums differ with the batch: values within bf16 noise, near-ties may swap
            torch.testing.assert_close(torch.tensor(got.next.named),
                                       alone[list(labels)], atol=0.05, rtol=0)
            assert got.next.token.id == int(alone.argmax()) or abs(
                got.next.token.logprob - float(alone.max())) < 0.05
    assert sched.kv_used_tokens == 0
    sched.stop(10.0)
    torch.cuda.empty_cache()
