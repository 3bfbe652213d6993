"""Data-parallel attention with a gathered, sharded MLP: 2 gloo processes give the logits of
one process with the whole MLP (DP 1), including a step where one rank has no tokens."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from service.engine.dp import DPMLP, DPGroup, DPRunner, DPStep
from service.engine.kv_pool import KVPool
from service.engine.runners.buckets import Buckets
from service.engine.runners.eager import EagerRunner
from service.engine.runners.graph import SegmentBackend
from tests.engine.helpers import PAGE, chunk, free_port, prompts, tiny_model

ATOL = 1e-4
# per step: (rank 0's prompt lengths, rank 1's); the last step leaves rank 1 idle
STEPS = [([5, 9], [7]), ([6, 3, 4], [12]), ([10], [])]


def rank_prompts(step: int, rank: int) -> list[list[int]]:
    lengths = STEPS[step][rank]
    return prompts(97, lengths, seed=100 * step + rank) if lengths else []


def reference() -> list[list[torch.Tensor]]:
    """DP 1: the unsharded model, eager, each step's prompts of both ranks in one batch."""
    model = tiny_model(seed=3)
    pool = KVPool(model.cfg, 1024, PAGE, torch.float32, "cpu")
    runner = EagerRunner(model)
    out = []
    for step in range(len(STEPS)):
        per_rank = []
        for rank in (0, 1):
            chunks = [chunk(pool, p) for p in rank_prompts(step, rank)]
            with torch.inference_mode():
                logits, *_ = runner.run(chunks, pool.cache)
            per_rank.append(logits)
        out.append(per_rank)
    return out


def _worker(rank: int, world: int, port: int, outdir: str, buckets: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    from service.engine.dp import close_dp, init_dp

    group = init_dp(rank, world, "gloo", f"tcp://127.0.0.1:{port}")
    model = tiny_model(seed=3)
    backend = SegmentBackend() if buckets else None
    runner = DPRunner(model, Buckets(buckets), backend, group)
    pool = KVPool(model.cfg, 1024, PAGE, torch.float32, "cpu")
    results = []
    with torch.inference_mode():
        if buckets:
            runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
        for step in range(len(STEPS)):
            chunks = [chunk(pool, p) for p in rank_prompts(step, rank)]
            logits, batch, mode = runner.run(chunks, pool.cache)
            results.append((logits, mode, batch.padded_tokens))
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    close_dp(group)
    # NOTE: skip interpreter finalization: gloo's worker threads can still hold work objects
    # whose teardown there aborts the process ("terminate called without an active
    # exception", SIGABRT) after everything above succeeded: about one run in 25 on the 2-core
    # CPU machine (pytorch/pytorch#179291 describes the mechanism). Failures above still raise.
    os._exit(0)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("buckets", [(), (8, 16, 32)], ids=["eager", "breakable"])
def test_two_gloo_ranks_match_dp1(ref, buckets, tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), buckets), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for step, (logits, mode, padded) in enumerate(got):
            want = ref[step][rank]
            assert logits.shape == want.shape
            torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
            counts = [sum(STEPS[step][r]) for r in (0, 1)]
            assert mode == ("graph" if buckets else "eager")
            # both ranks pad to the same row count: the largest rank's (or its bucket)
            expect = Buckets(buckets).pad_to_bucket(max(counts)) if buckets else max(counts)
            assert padded == expect


def test_world_one_dp_path_with_segments_matches_non_dp():
    """DP world size 1: real capture-only tensors in the breakable path; same logits."""
    model = tiny_model(seed=3)
    dp_runner = DPRunner(tiny_model(seed=3), Buckets((8, 16)), SegmentBackend(), DPGroup())
    assert isinstance(dp_runner.model.layers[0].mlp, DPMLP)
    pool = KVPool(model.cfg, 512, PAGE, torch.float32, "cpu")
    plain = EagerRunner(model)
    with torch.inference_mode():
        dp_runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
        for lengths in ([3, 4], [9, 2, 1], [16]):
            chunks = [chunk(pool, p) for p in prompts(97, lengths, seed=len(lengths))]
            got, _, mode = dp_runner.run(chunks, pool.cache)
            want, _, _ = plain.run(chunks, pool.cache)
            assert mode == "graph"
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert dp_runner.retained_input_bytes == 2 * 8  # two buckets, [gather_len, n_0] int32


def test_mlp_shards_reassemble_the_full_mlp():
    model = tiny_model(seed=4)
    mlp = model.layers[0].mlp
    shards = [DPMLP(mlp, _FakeGroup(r, 2), DPStep()) for r in (0, 1)]
    x = torch.randn(5, model.cfg.hidden_size)
    with torch.inference_mode():
        full = mlp(x)
        parts = sum(s.down_proj(torch.nn.functional.silu(s.gate_up_proj(x).chunk(2, -1)[0])
                                * s.gate_up_proj(x).chunk(2, -1)[1]) for s in shards)
    torch.testing.assert_close(parts, full, atol=1e-5, rtol=0)


class _FakeGroup:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
