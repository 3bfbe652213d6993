"""The capture-input retention gate (SGLang PR #32678, and further): a recording fake backend
sees what the runner asks it to keep. Non-DP: nothing, and the capture batch dies after
capture. DP: only the capture-only tensors (per-rank counts, gather length), byte-counted."""

from __future__ import annotations

import gc
import weakref

import torch

from service.engine.dp import DPCaptureInputs, DPGroup, DPRunner
from service.engine.kv_pool import KVPool
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.buckets import Buckets
from service.engine.runners.graph import SegmentBackend
from tests.engine.helpers import PAGE, tiny_model


class RecordingBackend(SegmentBackend):
    def __init__(self):
        super().__init__()
        self.given: dict[int, object] = {}

    def capture(self, key, run, attend, keep=None):
        self.given[key] = keep
        super().capture(key, run, attend, keep)


def capture(dp: DPGroup | None = None):
    model = tiny_model()
    backend = RecordingBackend()
    buckets = Buckets((4, 8, 16))
    runner = (BreakableRunner(model, buckets, backend) if dp is None
              else DPRunner(model, buckets, backend, dp))
    refs: list[weakref.ref] = []
    make = runner.capture_batch

    def watched(n, kv):
        batch = make(n, kv)
        refs.append(weakref.ref(batch))
        refs.append(weakref.ref(batch.input_ids))
        return batch

    runner.capture_batch = watched
    scratch = KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu")
    with torch.inference_mode():
        runner.capture(scratch.cache)
    scratch_ref = weakref.ref(scratch.cache.k[0])
    del scratch
    gc.collect()
    return runner, backend, refs, scratch_ref


def test_non_dp_retains_nothing_and_the_capture_batch_dies():
    runner, backend, refs, scratch_ref = capture()
    assert backend.given == {16: None, 8: None, 4: None}
    assert len(refs) == 6 and all(r() is None for r in refs)
    assert scratch_ref() is None  # nothing pins the scratch KV pool either
    assert backend.retained_bytes() == 0


def test_dp_retains_only_the_capture_only_tensors_and_counts_their_bytes():
    runner, backend, refs, scratch_ref = capture(dp=DPGroup())
    assert all(r() is None for r in refs) and scratch_ref() is None
    for n, kept in backend.given.items():
        assert isinstance(kept, DPCaptureInputs)
        assert kept.gather_len.tolist() == [n] and kept.global_num_tokens.tolist() == [n]
        assert backend.retained(n) is kept
    per_bucket = [k.nbytes for k in backend.given.values()]
    assert all(b <= 4096 for b in per_bucket)
    assert backend.retained_bytes() == sum(per_bucket) == 3 * 2 * 4  # (world+1) int32 each


def test_dp_graph_path_fills_the_retained_counts_before_replay():
    runner, backend, _, _ = capture(dp=DPGroup())
    pool = KVPool(runner.cfg, 128, PAGE, torch.float32, "cpu")
    from tests.engine.helpers import chunk, prompts

    c = [chunk(pool, prompts(97, [6], seed=9)[0])]
    with torch.inference_mode():
        logits, batch, mode = runner.run(c, pool.cache)
    assert mode == "graph" and batch.padded_tokens == 8
    assert backend.retained(8).packed.tolist() == [8, 6]  # [gather_len, n_0]
