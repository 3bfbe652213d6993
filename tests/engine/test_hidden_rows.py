"""The LM head's normed rows kept for chunks that ask (`SeqChunk.hidden`): the full graph, the
breakable graphs and eager all give the eager reference's rows; nothing is kept otherwise.
CPU (device-free graphs) always; CUDA graphs in bf16 where a GPU is present (marked gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.batch import build_batch
from tests.engine.helpers import chunk, prompts, runners_setup

setup = runners_setup(seed=9)


def reference(model, chunks, pool) -> torch.Tensor:
    """The eager model's final-norm last row of each chunk."""
    batch = build_batch(chunks, pool.cache, model.device)
    picked = torch.empty(len(chunks), model.cfg.hidden_size, dtype=model.dtype,
                         device=model.device)
    with torch.inference_mode():
        model(batch.input_ids, batch.positions, batch.meta, picked)
    return picked.float()


@pytest.mark.parametrize("lengths,runner", [([5, 9], "full"), ([20, 30], "breakable"),
                                            ([40, 50], "eager")])
def test_each_runner_keeps_the_rows_the_head_reads(setup, lengths, runner) -> None:
    model, runners, pool, tol = setup
    before = runners.runs[runner]
    chunks = [chunk(pool, ids) for ids in prompts(model.cfg.vocab_size, lengths, seed=1)]
    asking = [dataclasses.replace(c, hidden=True) for c in chunks]
    ref = reference(model, chunks, pool)
    logits, batch, _ = runners.prefill(asking, pool.cache)
    assert runners.runs[runner] == before + 1, runners.runs
    rows = [e - 1 for _, e in batch.logits_rows]
    got = batch.hidden[rows].float()
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    with torch.inference_mode():  # the head reads exactly those rows
        head = got.to(model.dtype) @ model.head_weight.T
    torch.testing.assert_close(head.float(), logits[rows].float(), atol=tol, rtol=tol)
    _, plain, _ = runners.prefill(chunks, pool.cache)
    assert plain.hidden is None  # nothing asked, nothing kept
