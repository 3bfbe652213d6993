"""Graph-backend logic without CUDA: step order, largest-first capture into shared static
buffers, attention steps reading the live batch, close()."""

from __future__ import annotations

import pytest
import torch

from service.engine.kv_pool import KVPool
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.buckets import Buckets
from service.engine.runners.graph import SegmentBackend
from tests.engine.helpers import PAGE, chunk, prompts, tiny_model


def test_capture_warms_up_then_records_and_replays_the_live_attention_in_order():
    events: list[str] = []
    backend = SegmentBackend()

    def run(steps):
        steps.dense(lambda: events.append("d0"))
        steps.attention(0)
        steps.dense(lambda: events.append("d1"))

    backend.capture("k", run, lambda layer: events.append(f"capture-attn{layer}"))
    # warm-up runs everything; capture records the dense steps (no run on this backend) and
    # runs the attention once between them, as a CUDA capture does
    assert events == ["d0", "capture-attn0", "d1", "capture-attn0"]
    events.clear()
    backend.replay("k", lambda layer: events.append(f"live-attn{layer}"))
    assert events == ["d0", "live-attn0", "d1"]
    assert backend.num_steps("k") == (2, 1) and backend.retained("k") is None
    with pytest.raises(AssertionError, match="captured twice"):
        backend.capture("k", run, lambda layer: None)
    backend.capture_whole("w", lambda: events.append("whole"))
    events.clear()
    backend.replay("w")
    assert events == ["whole"] and backend.num_steps("w") == (1, 0)
    backend.close()
    assert backend.keys == ()


class OrderBackend(SegmentBackend):
    def __init__(self):
        super().__init__()
        self.order: list[int] = []

    def capture(self, key, run, attend, keep=None):
        self.order.append(key)
        super().capture(key, run, attend, keep)


@pytest.fixture(scope="module")
def captured():
    model = tiny_model()
    backend = OrderBackend()
    runner = BreakableRunner(model, Buckets((4, 8, 12, 32)), backend)
    with torch.inference_mode():
        runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
    return runner, backend


def test_capture_is_largest_first_with_one_dense_step_more_than_attention_steps(captured):
    runner, backend = captured
    assert backend.order == [32, 12, 8, 4]
    layers = runner.cfg.num_layers
    for n in backend.order:
        assert backend.num_steps(n) == (layers + 1, layers)


def test_static_buffers_are_views_of_one_storage_for_every_bucket(captured):
    runner, _ = captured
    bufs = runner.bufs
    assert bufs.max_tokens == 32
    names = ("input_ids", "positions", "residual", "hidden", "qkv", "attn", "mlp_scratch")
    base = {name: None for name in names}
    for n in (32, 12, 8, 4):
        v = bufs.views(n)
        for name in names:
            t = getattr(v, name)
            assert t.shape[0] == n
            ptr = t.untyped_storage().data_ptr()
            assert base[name] in (None, ptr), f"{name} of bucket {n} has its own storage"
            base[name] = ptr
            assert t.data_ptr() == getattr(bufs.views(32), name).data_ptr()  # same start
    # the break-crossing qkv/attn and the MLP scratch share one arena (disjoint lifetimes)
    v = bufs.views(32)
    arena = bufs.arena.untyped_storage().data_ptr()
    assert {v.qkv.untyped_storage().data_ptr(), v.attn.untyped_storage().data_ptr(),
            v.mlp_scratch.untyped_storage().data_ptr()} == {arena}
    qkv_end = v.qkv.data_ptr() + v.qkv.numel() * 4
    assert v.attn.data_ptr() >= qkv_end  # attention reads qkv while writing attn: disjoint
    cfg = runner.cfg  # sized for the break; the MLP scratch takes the rows that fit
    assert bufs.arena.numel() == 32 * (2 * cfg.q_size + 2 * cfg.kv_size)
    assert v.mlp_scratch.numel() <= bufs.arena.numel()


def test_attention_reads_the_live_batch_not_the_capture_batch(captured):
    runner, _ = captured
    pool = KVPool(runner.cfg, 256, PAGE, torch.float32, "cpu")
    a = [chunk(pool, prompts(97, [7], seed=1)[0])]
    b = [chunk(pool, prompts(97, [6], seed=2)[0])]
    with torch.inference_mode():
        la, *_ = runner.run(a, pool.cache)
        lb, *_ = runner.run(b, pool.cache)
        la2, *_ = runner.run(a, pool.cache)
    assert not torch.equal(la, lb)
    torch.testing.assert_close(la2, la, atol=1e-5, rtol=0)


def test_close_frees_graphs_and_buffers():
    model = tiny_model()
    runner = BreakableRunner(model, Buckets((4, 8)), SegmentBackend())
    with torch.inference_mode():
        runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
    assert runner.captured == (4, 8) and runner.static_bytes > 0
    runner.close()
    runner.backend.close()
    assert runner.captured == () and runner.bufs is None and runner.static_bytes == 0
    assert not runner.can_run([], 4)


def test_capture_batches_respect_the_rope_table_and_use_only_the_dummy_page():
    model = tiny_model(max_position_embeddings=24)
    runner = BreakableRunner(model, Buckets((16, 64)), SegmentBackend())
    kv = KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache
    batch = runner.capture_batch(64, kv)
    assert batch.meta.q_lens == (24, 24, 16) and int(batch.positions.max()) == 23
    assert int(batch.meta.slot_mapping.max()) < PAGE and int(batch.meta.page_table.max()) == 0
    with torch.inference_mode():
        runner.capture(kv)
    assert runner.captured == (16, 64)
