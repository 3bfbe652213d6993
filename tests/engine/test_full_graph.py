"""Full graphs on CPU (device-free backend: a 'graph' is the whole forward kept as one step):
the fixed-shape inputs, which batches replay them, exactness against the eager model, the KV
pool bound at replay (not at capture), and the scratch pool left freeable after capture."""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref

import numpy as np
import pytest
import torch

from service.engine.batch import build_batch
from service.engine.kv_pool import KVPool
from service.engine.pages import DUMMY_SLOT
from service.engine.runners.full_buffers import FullBuffers
from service.engine.sampling import last_rows, unpack
from tests.engine.helpers import PAGE, Runners, chunk, prompts, tiny_cfg, tiny_model

ATOL = 1e-4
SEQS, PAGES = 3, 40


def make_runner(model=None, buckets=(4, 8, 16, 32, 64), full_max=32):
    return Runners(model or tiny_model(seed=7), buckets, full_max, SEQS, PAGES)


def eager(model, chunks, pool):
    b = build_batch(chunks, pool.cache, "cpu")
    with torch.inference_mode():
        return model(b.input_ids, b.positions, b.meta), b


def with_prefixes(model, pool, lengths, prefixes, seed):
    """Chunks of new tokens after cached prefixes (the prefixes' KV written eagerly first)."""
    full = prompts(model.cfg.vocab_size, [p + n for p, n in zip(prefixes, lengths)], seed)
    heads = [chunk(pool, ids[:p]) for ids, p in zip(full, prefixes) if p]
    if heads:
        eager(model, heads, pool)
    it = iter(heads)
    return [chunk(pool, ids[p:], p, list(next(it).pages) if p else None)
            for ids, p in zip(full, prefixes)]


def test_inputs_are_padded_to_fixed_shapes():
    bufs = FullBuffers(32, SEQS, PAGES, PAGE, 97, "cpu")
    pool = KVPool(tiny_cfg(), 512, PAGE, torch.float32, "cpu")
    chunks = with_prefixes(tiny_model(), pool, [5, 2], [6, 0], seed=1)
    bufs.words.fill_(-7)  # stale contents a load must overwrite where a graph reads
    batch = bufs.load(chunks, pool.cache, 16)
    ref = build_batch(chunks, pool.cache, "cpu", pad_to=16)
    v = bufs.views(16)
    assert batch.input_ids.data_ptr() == v.input_ids.data_ptr()
    assert torch.equal(v.input_ids, ref.input_ids) and torch.equal(v.positions, ref.positions)
    assert torch.equal(v.slot_mapping, ref.meta.slot_mapping)
    assert int(v.slot_mapping[7:].eq(DUMMY_SLOT).sum()) == 9  # 7 live rows, 9 padding rows
    assert v.cu_seqlens_q.tolist() == [0, 5, 7, 7]  # the unused sequence is empty
    assert v.prefix_lens.tolist() == [6, 0, 0]
    table = ref.meta.page_table
    assert torch.equal(v.page_table[:2, : table.shape[1]], table)
    assert v.page_table[:2, table.shape[1]:].eq(0).all()
    assert v.head_rows.tolist() == [4, 6, 0]  # each sequence's last token; padding reads row 0
    assert torch.equal(batch.meta.logits_indices, ref.meta.logits_indices)
    assert batch.logits_rows == ref.logits_rows and batch.last_rows.tolist() == [0, 1]
    # every input is a view of one buffer: the batch crosses in one host-to-device copy
    words = bufs.words.untyped_storage().data_ptr()
    assert all(getattr(v, f.name).untyped_storage().data_ptr() == words
               for f in dataclasses.fields(v))


def test_fits_limits_sequences_tokens_context_and_prompt_logprobs():
    bufs = FullBuffers(32, SEQS, PAGES, PAGE, 97, "cpu")
    pool = KVPool(tiny_cfg(), 1024, PAGE, torch.float32, "cpu")
    ids = prompts(97, [4] * 4, seed=2)
    assert bufs.fits([chunk(pool, x) for x in ids[:3]], 16)
    assert not bufs.fits([chunk(pool, x) for x in ids], 16)  # 4 sequences > 3
    assert not bufs.fits([chunk(pool, ids[0])], 64)  # bucket beyond the buffers
    long = chunk(pool, ids[0], prefix_len=PAGES * PAGE)  # 41 pages
    assert not bufs.fits([long], 16)
    c = chunk(pool, ids[1])
    assert not bufs.fits([dataclasses.replace(c, all_logits=True)], 16)  # every row's logits
    short = dataclasses.replace(chunk(pool, ids[2], prefix_len=3), pages=c.pages[:1])
    with pytest.raises(AssertionError, match="need 2 pages"):  # 7 positions, pages of 4
        bufs.load([short], pool.cache, 16)


@pytest.fixture(scope="module")
def runner():
    return make_runner()


def test_capture_adds_one_whole_step_per_small_bucket(runner):
    assert runner.breakable.captured == (4, 8, 16, 32, 64)
    assert runner.full.captured == (4, 8, 16, 32)
    for n in runner.full.captured:
        assert runner.backend.num_steps(("full", n)) == (1, 0)
    assert runner.full.kv_addrs.kv is None  # the scratch pool is not held after capture


@pytest.mark.parametrize("lengths, prefixes", [
    ([9], [0]),  # one prompt -> bucket 16
    ([5, 1, 9], [4, 0, 13]),  # prefixes read from the paged pool -> 16
    ([20, 7, 3], [0, 0, 8]),  # 30 -> 32
    ([4], [0]),  # exactly a bucket
])
def test_full_graph_matches_eager(runner, lengths, prefixes):
    pool = KVPool(runner.cfg, 2048, PAGE, torch.float32, "cpu")
    chunks = with_prefixes(runner.model, pool, lengths, prefixes, seed=sum(lengths))
    before = runner.full_forwards
    with torch.inference_mode():
        logits, batch, mode = runner.prefill(chunks, pool.cache)
        k_graph = [k.clone() for k in pool.cache.k]
        want, ref = eager(runner.model, chunks, pool)  # rewrites the same slots
    assert mode == "graph" and runner.full_forwards == before + 1
    assert batch.padded_tokens == runner.pad_to_bucket(sum(lengths))
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
    got, ref_last = unpack(batch.summary.get()), last_rows(want)  # reduced inside the graph
    assert [r.greedy.id for r in got] == [r.greedy.id for r in ref_last]
    for a, b in zip(got, ref_last):
        assert [t.id for t in a.top] == [t.id for t in b.top]
        torch.testing.assert_close(torch.tensor([t.logprob for t in a.top]),
                                   torch.tensor([t.logprob for t in b.top]), atol=ATOL, rtol=0)
    for a, b in zip(k_graph, pool.cache.k):  # the graph stored the same KV the eager pass did
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert batch.logits_rows == ref.logits_rows


def test_too_many_sequences_or_tokens_take_the_breakable_graph(runner):
    pool = KVPool(runner.cfg, 2048, PAGE, torch.float32, "cpu")
    for lengths in ([2, 3, 4, 5], [40]):  # 4 sequences > 3; 40 tokens -> bucket 64
        chunks = [chunk(pool, x) for x in prompts(runner.cfg.vocab_size, lengths, seed=4)]
        before = runner.full_forwards
        with torch.inference_mode():
            logits, _, mode = runner.prefill(chunks, pool.cache)
        assert mode == "graph" and runner.full_forwards == before
        torch.testing.assert_close(logits, eager(runner.model, chunks, pool)[0], atol=ATOL,
                                   rtol=0)


def test_the_pool_is_bound_at_replay(runner):
    """Two pools with different prefix contents: each replay reads the pool it is given."""
    pools = [KVPool(runner.cfg, 512, PAGE, torch.float32, "cpu") for _ in range(2)]
    outs = []
    for seed, pool in enumerate(pools):
        chunks = with_prefixes(runner.model, pool, [6], [10], seed=seed)
        with torch.inference_mode():
            logits, _, _ = runner.prefill(chunks, pool.cache)
        outs.append(logits)
        torch.testing.assert_close(logits, eager(runner.model, chunks, pool)[0], atol=ATOL,
                                   rtol=0)
        assert runner.full.kv_addrs.kv is pool.cache
    assert not torch.equal(outs[0], outs[1])


def test_scratch_pool_is_freeable_after_capture():
    from service.engine.runners.breakable import BreakableRunner
    from service.engine.runners.buckets import Buckets
    from service.engine.runners.full import FullGraphRunner
    from service.engine.runners.graph import SegmentBackend

    model = tiny_model(seed=3)
    breakable = BreakableRunner(model, Buckets((4, 8)), SegmentBackend())
    full = FullGraphRunner(breakable, 8, SEQS, PAGES)
    scratch = KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu")
    cache, layer0 = weakref.ref(scratch.cache), weakref.ref(scratch.cache.k[0])
    with torch.inference_mode():
        breakable.capture(scratch.cache)
        full.capture(scratch.cache)
    del scratch
    gc.collect()
    assert cache() is None and layer0() is None
    assert full.captured == (4, 8)


def test_no_full_graphs_when_off_and_only_up_to_the_limit():
    runner = make_runner(full_max=0)
    assert runner.full is None and runner.backend.keys == (64, 32, 16, 8, 4)
    some = make_runner(buckets=(4, 8, 16), full_max=8)
    assert some.full.captured == (4, 8)
    pool = KVPool(some.cfg, 512, PAGE, torch.float32, "cpu")
    chunks = [chunk(pool, x) for x in prompts(some.cfg.vocab_size, [3, 4], seed=9)]
    with torch.inference_mode():
        logits, _, _ = some.prefill(chunks, pool.cache)
    assert some.full_forwards == 1
    torch.testing.assert_close(logits, eager(some.model, chunks, pool)[0], atol=ATOL, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check through Triton's interpreter")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_full_graph_on_triton_kernels_matches_reference():
    """The kernels read the fixed metadata and the pool's addresses from memory (cache table)."""
    from tests.engine.test_runner_triton import triton_vs_reference

    runner, got, batch, mode, want, tails, pool, ref_pool = triton_vs_reference(
        full_max=16)  # the prefixes go through a full graph too
    assert mode == "graph" and runner.full_forwards == 2 and batch.padded_tokens == 8
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    live = np.concatenate([np.arange(p * 4, p * 4 + 4) for c in tails for p in c.pages])
    for k, kr in zip(pool.cache.k, ref_pool.cache.k):
        torch.testing.assert_close(k[live], kr[live], atol=1e-4, rtol=0)


def test_settings_reach_the_engine_config():
    from service.config import ConfigError, load_settings, resolve

    eng, _ = resolve(load_settings({"CUDA_GRAPH_FULL_MAX_TOKENS": "256",
                                    "CUDA_GRAPH_FULL_MAX_SEQS": "4"}), False)
    assert (eng.cuda_graph_full_max_tokens, eng.cuda_graph_full_max_seqs) == (256, 4)
    default, _ = resolve(load_settings({}), False)
    assert (default.cuda_graph_full_max_tokens, default.cuda_graph_full_max_seqs) == (1024, 8)
    with pytest.raises(ConfigError, match="CUDA_GRAPH_FULL_MAX_SEQS"):
        load_settings({"CUDA_GRAPH_FULL_MAX_SEQS": "0"})
