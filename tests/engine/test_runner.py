"""The runners on CPU: the breakable graphs (device-free backend) against the eager model,
padding rules, chunked prefill, and the engine core's CPU path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.batch import SeqChunk, build_batch
from service.engine.core import EngineCore
from service.engine.kv_pool import KVPool
from tests.engine.helpers import (
    PAGE,
    Runners,
    chunk,
    engine_cfg,
    prompts,
    tiny_loaded,
    tiny_model,
)

ATOL = 1e-4


def make_runner(buckets=(4, 8, 16, 32, 64), model=None):
    runners = Runners(model or tiny_model(), buckets)
    return runners, KVPool(runners.cfg, 2048, PAGE, torch.float32, "cpu")


def eager_logits(model, chunks, pool):
    b = build_batch(chunks, pool.cache, "cpu")
    with torch.inference_mode():
        out = model(b.input_ids, b.positions, b.meta)
    return [out[s:e] for s, e in b.logits_rows]


@pytest.fixture(scope="module")
def setup():
    return make_runner()


def _with_prefixes(runner, pool, lengths, prefixes, seed):
    """Chunks of new tokens after cached prefixes (the prefixes' KV written eagerly first)."""
    vocab = runner.cfg.vocab_size
    full = prompts(vocab, [p + n for p, n in zip(prefixes, lengths)], seed)
    heads = [chunk(pool, ids[:p]) for ids, p in zip(full, prefixes) if p]
    if heads:
        eager_logits(runner.model, heads, pool)
    it = iter(heads)
    return [chunk(pool, ids[p:], p, list(next(it).pages) if p else None)
            for ids, p in zip(full, prefixes)]


@pytest.mark.parametrize("lengths, prefixes", [
    ([3, 7, 2], [0, 0, 0]),  # 12 tokens -> bucket 16
    ([5, 1, 9, 6], [4, 0, 13, 2]),  # 21 tokens, prefixes from the paged pool -> 32
    ([33, 20], [8, 0]),  # 53 -> 64
    ([4], [0]),  # exactly a bucket
])
def test_breakable_path_matches_eager(setup, lengths, prefixes):
    runner, pool = setup
    chunks = _with_prefixes(runner, pool, lengths, prefixes, seed=sum(lengths))
    ref = eager_logits(runner.model, chunks, pool)
    with torch.inference_mode():
        logits, batch, mode = runner.prefill(chunks, pool.cache)
    assert mode == "graph" and batch.padded_tokens == runner.pad_to_bucket(sum(lengths))
    for (s, e), r in zip(batch.logits_rows, ref):
        torch.testing.assert_close(logits[s:e], r, atol=ATOL, rtol=0)


def test_padding_never_reaches_outputs_or_kv(setup):
    runner, pool = setup
    chunks = [chunk(pool, ids) for ids in prompts(runner.cfg.vocab_size, [5, 4], seed=3)]
    before = [k.clone() for k in pool.cache.k]
    with torch.inference_mode():
        bufs = runner.breakable.bufs
        for buf in (bufs.residual, bufs.hidden, bufs.arena):
            buf.fill_(float("nan"))  # stale garbage in every padding row
        logits, batch, mode = runner.prefill(chunks, pool.cache)
    assert mode == "graph" and batch.padded_tokens == 16 and batch.num_tokens == 9
    assert torch.isfinite(logits).all()
    # only the real tokens' slots changed; padding wrote no KV anywhere (not even slot 0)
    real = {p * PAGE + i for c in chunks for p in c.pages for i in range(PAGE)}
    for k0, k1 in zip(before, pool.cache.k):
        changed = {int(s) for s in (k0 != k1).any(-1).any(-1).nonzero().flatten()}
        assert changed and changed <= real and 0 not in changed
    ref = eager_logits(runner.model, chunks, pool)
    for (s, e), r in zip(batch.logits_rows, ref):
        torch.testing.assert_close(logits[s:e], r, atol=ATOL, rtol=0)


def test_mlp_in_row_chunks_matches_eager(monkeypatch):
    """2F (320) much wider than the attention buffers (96): the arena holds 16 MLP rows, so
    buckets 24, 40 and 64 run the MLP in 2, 3 and 4 chunks, written over their own input rows."""
    from service.engine.runners import buffers

    monkeypatch.setattr(buffers, "MLP_MIN_ROWS", 16)  # tiny model: chunks of 16 rows

    model = tiny_model(seed=5, intermediate_size=160)
    runners = Runners(model, (8, 16, 24, 40, 64))
    bufs = runners.breakable.bufs
    assert bufs.mlp_rows == 16 and bufs.arena.numel() == 64 * 96
    pool = KVPool(model.cfg, 2048, PAGE, torch.float32, "cpu")
    for n, lengths in ((8, [3, 4]), (16, [16]), (24, [9, 11]), (40, [17, 5, 12]), (64, [30, 34])):
        chunks = [chunk(pool, ids) for ids in prompts(model.cfg.vocab_size, lengths, seed=n)]
        assert bufs.views(n).mlp_scratch.shape[0] == min(n, 16)
        ref = eager_logits(model, chunks, pool)
        with torch.inference_mode():
            logits, batch, mode = runners.prefill(chunks, pool.cache)
        assert mode == "graph" and batch.padded_tokens == n
        for (s, e), r in zip(batch.logits_rows, ref):
            torch.testing.assert_close(logits[s:e], r, atol=ATOL, rtol=0)
        for c in chunks:
            pool.allocator.free(list(c.pages))


def test_same_logits_whichever_bucket_pads_the_batch():
    model = tiny_model(seed=1)
    outs = []
    for buckets in ((12,), (16,), (24,)):
        runner, pool = make_runner(buckets, model)
        chunks = [chunk(pool, ids) for ids in prompts(model.cfg.vocab_size, [6, 6], seed=4)]
        with torch.inference_mode():
            logits, batch, mode = runner.prefill(chunks, pool.cache)
        assert mode == "graph" and batch.padded_tokens == buckets[0]
        outs.append(logits)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tokens, mode", [(3, "graph"), (5, "graph"), (17, "graph"),
                                          (33, "graph"), (64, "graph"), (65, "eager")])
def test_eager_when_over_the_largest_bucket(tokens, mode):
    runner, pool = make_runner((4, 8, 16, 32, 64))
    chunks = [chunk(pool, prompts(runner.cfg.vocab_size, [tokens], seed=tokens)[0])]
    ref = eager_logits(runner.model, chunks, pool)
    with torch.inference_mode():
        logits, _, got = runner.prefill(chunks, pool.cache)
    assert got == mode and runner.counts[mode] == 1
    torch.testing.assert_close(logits, ref[0], atol=ATOL, rtol=0)


def test_eager_when_padding_would_more_than_double():
    runner, pool = make_runner((4, 16))
    for n, mode in ((5, "eager"), (8, "graph"), (3, "graph"), (1, "eager")):
        chunks = [chunk(pool, prompts(runner.cfg.vocab_size, [n], seed=n)[0])]
        with torch.inference_mode():
            _, batch, got = runner.prefill(chunks, pool.cache)
        assert got == mode, n
        assert batch.padded_tokens == (runner.pad_to_bucket(n) if mode == "graph" else n)
    assert runner.counts == {"graph": 2, "eager": 2}


@pytest.mark.parametrize("chunk_tokens", [16, 7])
def test_chunked_prefill_equals_one_pass(chunk_tokens):
    core = EngineCore(engine_cfg(max_prefill_tokens=64), loaded=tiny_loaded(seed=2))
    ids = prompts(core.model_cfg.vocab_size, [50], seed=5)[0]
    one = core.forward([chunk(core.pool, ids)]).logits[0][-1]
    core.pool.allocator.free(list(range(1, 1 + -(-50 // PAGE))))
    chunked = core.prefill_chunked(ids, chunk_tokens)
    torch.testing.assert_close(chunked, one, atol=ATOL, rtol=0)
    assert core.pool.allocator.num_free == core.pool.allocator.capacity
    assert core.forward_counts["eager"] == 1 + -(-50 // chunk_tokens)


def test_chunked_prefill_through_the_breakable_path_equals_one_pass():
    runner, pool = make_runner((4, 8, 16, 32, 64))
    ids = prompts(runner.cfg.vocab_size, [40], seed=6)[0]
    one = eager_logits(runner.model, [chunk(pool, ids)], pool)[0][-1]
    pages = list(pool.allocator.alloc(10))
    out = None
    for s in range(0, 40, 10):  # 4 chunks of 10 -> bucket 16
        c = chunk(pool, ids[s : s + 10], s, pages)
        with torch.inference_mode():
            logits, _, mode = runner.prefill([c], pool.cache)
        assert mode == "graph"
        out = logits[-1]
    torch.testing.assert_close(out, one, atol=ATOL, rtol=0)


def test_core_cpu_path_reports_and_forwards(caplog):
    with caplog.at_level("INFO"):
        core = EngineCore(engine_cfg(), loaded=tiny_loaded())
    assert "engine ready on cpu" in caplog.text and "KV_CACHE_BYTES" in caplog.text
    m = core.memory
    assert m.path == "cpu" and m.kv_bytes == core.pool.nbytes <= engine_cfg().kv_cache_bytes
    assert [r.name for r in core.runners] == ["eager"] and core.graphs is None
    assert m.kv_tokens == core.pool.capacity_tokens > 0 and m.weights_bytes > 0
    chunks = [chunk(core.pool, ids) for ids in prompts(97, [3, 9], seed=7)]
    chunks[1] = dataclasses.replace(chunks[1], all_logits=True)
    out = core.forward(chunks)
    assert out.mode == "eager" and [t.shape for t in out.logits] == [(1, 97), (9, 97)]
    assert out.logits[0].device == core.device and core.forward_counts == {"graph": 0, "eager": 1}
    assert [s.greedy.id for s in out.last] == [int(x[-1].argmax()) for x in out.logits]
    core.close()


def test_staged_batches_reuse_the_bound_break_and_still_match_eager(monkeypatch):
    """With staging (the CUDA default), a batch of a shape seen before reuses the attention
    break bound for it; it must still read the new batch's metadata and tokens. Shapes that
    differ in anything the launch depends on (live tokens, longest prompt, longest prefix)
    bind their own."""
    model = tiny_model(seed=4)
    runner = Runners(model, (16, 32), staging=True)
    pool = KVPool(model.cfg, 2048, PAGE, torch.float32, "cpu")
    binds = []
    plan = type(model.attn).plan
    monkeypatch.setattr(type(model.attn), "plan",
                        lambda self, *a, **k: binds.append(1) or plan(self, *a, **k))
    shapes = [([5, 7], [0, 0]), ([5, 7], [0, 0]), ([5, 7], [0, 0]), ([7, 5], [0, 0]),
              ([5, 7], [4, 0]), ([5, 7], [4, 0]), ([6, 6], [0, 0])]
    for i, (lengths, prefixes) in enumerate(shapes):
        chunks = _with_prefixes(runner, pool, lengths, prefixes, seed=100 + i)
        chunks = [SeqChunk(c.token_ids, c.prefix_len, c.pages) for c in chunks]
        ref = eager_logits(model, chunks, pool)
        with torch.inference_mode():
            logits, batch, mode = runner.prefill(chunks, pool.cache)
        assert mode == "graph" and batch.layout is not None
        for (s, e), r in zip(batch.logits_rows, ref):
            torch.testing.assert_close(logits[s:e], r, atol=ATOL, rtol=0)
    # binds: the first [5, 7]; [7, 5] has the same layout and maxima (reused); the prefixed
    # [5, 7] (another longest prefix); [6, 6] (another longest prompt)
    assert len(binds) == 3


def test_warm_up_batches_fit_and_write_only_the_dummy_page():
    """EngineCore.warm_up's batches: the first has more prompts than a full graph takes, each
    other one more new tokens than a smaller tier of the prefix-batch attention configs covers;
    every prompt follows a one-page cached prefix, every page is the dummy page, and none exceeds
    the batch budget or the context. On the CPU (no graphs) warm-up runs nothing."""
    from kernels.extend_attention_config import SMALL_CONFIGS, prefix_batch_rows
    from service.engine.core import warm_up_batches

    rows = prefix_batch_rows()
    bounds = sorted({b for tiers in SMALL_CONFIGS.values() for b, _ in tiers})
    assert rows[0] <= bounds[0] and len(rows) == len(bounds) + 2, (rows, bounds)
    assert all(b < n for b, n in zip(bounds, rows[1:])) and rows[-1] < 8192 - 32
    batches = warm_up_batches(8, 16, 8192, 8192)
    assert len(batches[0]) == 9 and [len(b) for b in batches[1:]] == [1] * (len(rows) - 1)
    assert [b[0].num_tokens for b in batches] == list(rows)
    for b in batches:
        for c in b:
            assert c.prefix_len == 16 and set(c.pages) == {0}  # page 0: the dummy page
            assert len(c.pages) == -(-(16 + c.num_tokens) // 16) and c.ids is not None
    # the budget and the context leave out the long ones
    assert len(warm_up_batches(8, 16, rows[-2], 8192)) == len(rows) - 1
    assert len(warm_up_batches(8, 16, 8192, rows[-1])) == len(rows) - 1
    core = EngineCore(engine_cfg(), loaded=tiny_loaded())
    core.warm_up()
    assert core.forward_counts == {"graph": 0, "eager": 0}
    core.close()
