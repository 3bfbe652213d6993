"""Mean/cls pooling on the device: one vectorised reduction equals the per-chunk loop, and the
full graph, breakable graphs and eager runners all pool (CPU device-free graphs; CUDA, gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.batch import build_batch
from service.engine.kv_pool import KVPool
from service.engine.runners import pooled_rows
from service.model.families import preset
from service.model.loader import LoadedModel, random_model
from tests.engine.helpers import chunk, engine_cfg, prompts, runners_setup, tiny_model


def loop_pooled(hidden: torch.Tensor, chunks) -> torch.Tensor:
    """The reference: a Python loop over the chunks' row slices."""
    out, start = [], 0
    for c in chunks:
        rows = hidden[start:start + c.num_tokens]
        start += c.num_tokens
        if c.pool == "mean":
            out.append(rows.float().sum(0))
        elif c.pool == "cls":
            out.append(rows[0].float())
    return torch.stack(out)


def pooling(chunks, pools):
    return [dataclasses.replace(c, pool=p) for c, p in zip(chunks, pools)]


@pytest.mark.parametrize("lengths,pools,pad,extra", [
    ([1, 7, 30], ["mean", "mean", "mean"], 0, 0),
    ([5, 1, 12], ["cls", "cls", "cls"], 3, 0),
    ([4, 9, 2, 6], ["", "mean", "cls", ""], 9, 4),  # padded rows, full-graph style cu tail
    ([3, 8], ["cls", "mean"], 0, 2),
])
def test_vectorised_reduction_equals_the_loop(lengths, pools, pad, extra) -> None:
    pool = KVPool(tiny_model().cfg, 256, 4, torch.float32, "cpu")
    chunks = pooling([chunk(pool, x) for x in prompts(97, lengths, seed=2)], pools)
    t = sum(lengths)
    hidden = torch.randn(t + pad, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + [t] * extra,
                      dtype=torch.int32)
    got = pooled_rows(hidden, cu, chunks)
    torch.testing.assert_close(got, loop_pooled(hidden, chunks), atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32


setup = runners_setup(seed=5)


def reference(model, chunks, pool) -> torch.Tensor:
    """The eager model's final-norm rows, pooled by the loop."""
    batch = build_batch(chunks, pool.cache, model.device)
    with torch.inference_mode():
        h = model.hidden_states(batch.input_ids, batch.positions, batch.meta)
    return loop_pooled(h, chunks).cpu()


def close(got, ref, tol) -> None:
    scale = ref.abs().amax(-1, keepdim=True).clamp(min=1.0)  # sums grow with the row count
    torch.testing.assert_close(got.cpu() / scale, ref / scale, atol=tol, rtol=tol)


@pytest.mark.parametrize("lengths,runner", [([5, 9, 3], "full"), ([20, 30, 7], "breakable"),
                                            ([40, 50, 9], "eager")])
def test_each_runner_pools_like_eager(setup, lengths, runner) -> None:
    model, runners, pool, tol = setup
    chunks = pooling([chunk(pool, x) for x in prompts(model.cfg.vocab_size, lengths, seed=4)],
                     ["mean", "", "cls"])
    ref = reference(model, chunks, pool)
    before, graphs = runners.runs[runner], runners.counts["graph"]
    _, batch, mode = runners.prefill(chunks, pool.cache)
    assert runners.runs[runner] == before + 1, runners.runs
    assert runners.counts["graph"] == graphs + (mode == "graph") and (mode == "graph") == (
        runner != "eager")
    assert batch.pooled.shape == (2, model.cfg.hidden_size)
    close(batch.pooled, ref, tol)
    _, plain, _ = runners.prefill(pooling(chunks, ["", "", ""]), pool.cache)
    assert plain.pooled is None  # nothing asked, nothing reduced


def test_a_prompt_pooled_across_chunks_sums_to_the_whole(setup) -> None:
    model, runners, pool, tol = setup
    ids = prompts(model.cfg.vocab_size, [90], seed=6)[0]
    whole = reference(model, pooling([chunk(pool, ids)], ["mean"]), pool)
    first = pooling([chunk(pool, ids[:30])], ["mean"])  # 30 tokens: a full graph's bucket
    second = pooling([chunk(pool, ids[30:], 30, first[0].pages)], ["mean"])  # 60: breakable
    total = runners.prefill(first, pool.cache)[1].pooled
    total = total + runners.prefill(second, pool.cache)[1].pooled
    assert runners.full_forwards >= 1 and runners.runs["breakable"] >= 1
    close(total, whole, tol)


@pytest.mark.parametrize("lengths,runner", [([300, 20], "full"), ([900, 600], "breakable")])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_core_pools_in_graphs(lengths, runner) -> None:
    from service.engine.core import EngineCore

    cfg = preset("smollm2-135m", num_layers=4)
    loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16), None, cfg, "random", 0.0)
    core = EngineCore(engine_cfg(device="cuda", dtype="bfloat16", mem_fraction_static=0.3,
                                 max_prefill_tokens=2048, cuda_graph_max_tokens=2048,
                                 page_size=16), loaded=loaded)
    try:
        chunks = pooling([chunk(core.pool, x) for x in prompts(cfg.vocab_size, lengths, seed=7)],
                         ["mean", "cls"])
        graphs, runs = core.forward_counts["graph"], core.runs[runner]
        out = core.forward(chunks)
        assert out.mode == "graph" and core.forward_counts["graph"] == graphs + 1
        assert core.runs[runner] == runs + 1
        ref = reference(core.model, chunks, core.pool)
        close(torch.stack([out.pooled[0], out.pooled[1]]), ref, 3e-2)
    finally:
        core.close()
        torch.cuda.empty_cache()
