"""The breakable path on the Triton kernels (CPU: Triton's interpreter), against the PyTorch
reference model: the launchers accept the static-buffer views (strided qkv/rope slices, the
in-place SiLU, attention into the arena, QKV bias via addmm) with and without DP."""

from __future__ import annotations

import os

import pytest
import torch

from service.engine.batch import build_batch
from service.engine.dp import DPGroup, DPRunner
from service.engine.kv_pool import KVPool
from service.engine.runners.buckets import Buckets
from service.engine.runners.graph import SegmentBackend
from service.model.loader import random_model
from tests.engine.helpers import Runners, chunk, prompts, tiny_cfg

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU check through Triton's interpreter"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # the interpreter's


def triton_vs_reference(full_max: int = 0, dp: DPGroup | None = None):
    """A 3-layer Qwen2-style model on the Triton kernels in captured runners and the same
    weights on the reference path: two prompts' 4-token prefixes, then their tails after them.
    Returns (runner, logits, batch, mode, want, tails, pool, ref_pool), those of the tails."""
    cfg = tiny_cfg(arch="qwen2", qkv_bias=True, num_layers=3)
    tri = random_model(cfg, "cpu", torch.float32, attn_backend="triton", seed=1)
    tri.set_kernels(True)
    ref = random_model(cfg, "cpu", torch.float32, attn_backend="torch", seed=1)
    if dp is None:
        runner = Runners(tri, (8, 16), full_max, seqs=3, pages=40)
    else:
        runner = DPRunner(tri, Buckets((8, 16)), SegmentBackend(), dp)
        with torch.inference_mode():
            runner.capture(KVPool(cfg, 4, 4, torch.float32, "cpu").cache)
        runner.prefill = runner.run
    pool, ref_pool = (KVPool(cfg, 256, 4, torch.float32, "cpu") for _ in range(2))
    ps = prompts(cfg.vocab_size, [9, 5], seed=3)
    heads = [chunk(pool, p[:4]) for p in ps]
    with torch.inference_mode():
        runner.prefill(heads, pool.cache)  # prefixes into the paged pool
        b = build_batch(heads, ref_pool.cache, "cpu")
        ref(b.input_ids, b.positions, b.meta)
        tails = [chunk(pool, p[4:], 4, list(h.pages)) for p, h in zip(ps, heads)]
        got, batch, mode = runner.prefill(tails, pool.cache)
        b = build_batch(tails, ref_pool.cache, "cpu")
        want = ref(b.input_ids, b.positions, b.meta)
    return runner, got, batch, mode, want, tails, pool, ref_pool


@pytest.mark.parametrize("dp", [None, DPGroup()], ids=["plain", "dp1"])
def test_triton_kernels_through_static_views_match_reference(dp):
    _, got, batch, mode, want, *_ = triton_vs_reference(dp=dp)
    assert mode == "graph" and batch.padded_tokens == 8
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
