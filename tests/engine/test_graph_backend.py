"""Graph-backend logic without CUDA: step order, hooks, largest-first capture into shared
static buffers, breaks reading the live batch, close()."""

from __future__ import annotations

import pytest
import torch

from service.engine.buckets import Buckets
from service.engine.graph import SegmentBackend
from service.engine.kv_pool import KVPool
from service.engine.runner import PrefillRunner
from tests.engine.helpers import PAGE, chunk, prompts, tiny_model


def test_capture_one_warms_up_then_hooks_then_captures_and_replays_in_order():
    events: list[str] = []
    backend = SegmentBackend()

    def run_once(rec):
        rec.dense(lambda: events.append("d0"))
        rec.brk(lambda: events.append("b0"))
        rec.dense(lambda: events.append("d1"))

    backend.capture_one("k", run_once, post_warmup_hook=lambda: events.append("hook"))
    # warm-up runs everything; capture records dense steps (no run on this backend) and runs
    # the break once between them, as a CUDA capture does
    assert events == ["d0", "b0", "d1", "hook", "b0"]
    events.clear()
    backend.replay("k")
    assert events == ["d0", "b0", "d1"]
    assert backend.num_steps("k") == (2, 1) and backend.retained("k") is None
    with pytest.raises(AssertionError, match="captured twice"):
        backend.capture_one("k", run_once)
    backend.close()
    assert backend.shape_keys == ()


class OrderBackend(SegmentBackend):
    def __init__(self):
        super().__init__()
        self.order: list[int] = []

    def capture_one(self, shape_key, run_once, capture_inputs=None, post_warmup_hook=None):
        self.order.append(shape_key)
        super().capture_one(shape_key, run_once, capture_inputs, post_warmup_hook)


@pytest.fixture(scope="module")
def captured():
    model = tiny_model()
    backend = OrderBackend()
    runner = PrefillRunner(model, Buckets((4, 8, 12, 32)), backend)
    with torch.inference_mode():
        runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
    return runner, backend


def test_capture_is_largest_first_with_one_segment_more_than_breaks(captured):
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


def test_breaks_read_the_live_batch_not_the_capture_batch(captured):
    runner, _ = captured
    pool = KVPool(runner.cfg, 256, PAGE, torch.float32, "cpu")
    a = [chunk(pool, prompts(97, [7], seed=1)[0])]
    b = [chunk(pool, prompts(97, [6], seed=2)[0])]
    with torch.inference_mode():
        la, *_ = runner.prefill(a, pool.cache)
        lb, *_ = runner.prefill(b, pool.cache)
        la2, *_ = runner.prefill(a, pool.cache)
    assert not torch.equal(la, lb)
    torch.testing.assert_close(la2, la, atol=1e-5, rtol=0)
    assert runner._live is None  # the handle is cleared after each replay


def test_close_frees_graphs_and_buffers():
    model = tiny_model()
    runner = PrefillRunner(model, Buckets((4, 8)), SegmentBackend())
    with torch.inference_mode():
        runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
    assert runner.captured == (4, 8) and runner.static_bytes > 0
    runner.close()
    assert runner.captured == () and runner.bufs is None and runner.static_bytes == 0
    assert not runner.can_use_graph(4)


def test_capture_batches_respect_the_rope_table_and_use_only_the_dummy_page():
    model = tiny_model(max_position_embeddings=24)
    runner = PrefillRunner(model, Buckets((16, 64)), SegmentBackend())
    kv = KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache
    batch = runner.capture_batch(64, kv)
    assert batch.meta.q_lens == (24, 24, 16) and int(batch.positions.max()) == 23
    assert int(batch.meta.slot_mapping.max()) < PAGE and int(batch.meta.page_table.max()) == 0
    with torch.inference_mode():
        runner.capture(kv)
    assert runner.captured == (16, 64)


def test_shared_dense_steps_are_captured_once_and_replayed_at_each_use():
    events: list[str] = []
    backend = SegmentBackend()

    def run_once(rec):
        rec.dense(lambda: events.append("first"))
        for i in range(3):
            rec.brk(lambda i=i: events.append(f"b{i}"))
            rec.dense(lambda: events.append("mid"), share="mid")

    backend.capture_one("k", run_once)
    events.clear()
    backend.replay("k")
    assert events == ["first", "b0", "mid", "b1", "mid", "b2", "mid"]
    assert backend.num_steps("k") == (4, 3)
    # SegmentBackend's "graphs" are functions; the distinct-graph count is the CUDA backend's
    steps = backend._steps["k"]
    assert steps[2][1] is steps[4][1] is steps[6][1], "one step object serves every layer"


@pytest.mark.parametrize("layers", [2, 4])
def test_layer_shared_segments_give_the_per_layer_output(layers):
    """Buckets <= shared_max_tokens replay ONE middle segment per layer, its weights picked by
    the device counter; the logits equal the per-layer segments' and the eager forward's."""
    pool = KVPool(tiny_model(num_layers=layers).cfg, 256, PAGE, torch.float32, "cpu")
    ps = prompts(97, [5, 9], seed=4)
    chunks = [chunk(pool, p) for p in ps]
    out = {}
    for name, shared in (("per-layer", 0), ("shared", 16)):
        model = tiny_model(seed=2, num_layers=layers)
        runner = PrefillRunner(model, Buckets((16, 32)), SegmentBackend(),
                               shared_max_tokens=shared)
        with torch.inference_mode():
            runner.capture(KVPool(model.cfg, PAGE, PAGE, torch.float32, "cpu").cache)
            logits, batch, mode = runner.prefill(chunks, pool.cache)
            eager = runner.forward_eager(batch)
        assert mode == "graph" and batch.padded_tokens == 16
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=0)
        steps = runner.backend._steps[16]
        mids = {id(fn) for kind, fn in steps[2:-1:2]}
        assert len(mids) == (1 if shared else layers - 1)
        assert len({id(fn) for kind, fn in runner.backend._steps[32][2:-1:2]}) == layers - 1
        assert int(runner._layer) == (layers - 1 if shared else 0)
        out[name] = logits
    torch.testing.assert_close(out["shared"], out["per-layer"], atol=1e-5, rtol=0)


def test_stacking_keeps_the_parameters_and_frees_their_old_storage():
    from service.model.stacked import stack_layers

    model = tiny_model(seed=5, num_layers=3)
    before = [p.detach().clone() for p in model.layers.parameters()]
    st = stack_layers(model)
    assert stack_layers(model) is st
    for p, b in zip(model.layers.parameters(), before):
        assert torch.equal(p, b)
    for i, lay in enumerate(model.layers):
        assert lay.mlp.down_proj.weight.data_ptr() == st.down[i].data_ptr()
        assert lay.input_layernorm.weight.data_ptr() == st.input_norm[i].data_ptr()
