"""Post-capture KV sizing arithmetic with an injected memory reader (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from service.engine.core import EngineCore
from service.engine.kv_pool import KVPool
from service.engine.memory import (
    InsufficientMemory,
    plan_kv,
    size_kv,
    smallest_workable_fraction,
)
from service.engine.pages import pages_for
from service.engine.runners.capture import capture, eager_peak
from service.engine.runners.eager import EagerRunner
from tests.engine.helpers import PAGE, engine_cfg, tiny_cfg, tiny_loaded, tiny_model

MIB, GIB = 1 << 20, 1 << 30


def scripted(*values: int):
    it = iter(values)
    return lambda: next(it)


def pool_bytes(cfg, tokens: int, page: int, dtype_bytes: int) -> int:
    slots = (pages_for(tokens, page) + 1) * page
    return 2 * cfg.num_layers * slots * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


@pytest.mark.parametrize("free_before, free_now, frac, granule", [
    (100 * MIB, 60 * MIB, 0.85, 1),
    (100 * MIB, 60 * MIB, 0.85, 2 * MIB),
    (141 * GIB, 130 * GIB, 0.85, 2 * MIB),
    (80 * GIB, 50 * GIB, 0.5, 2 * MIB),
])
def test_plan_follows_the_formula_and_the_pool_fits(free_before, free_now, frac, granule):
    cfg = tiny_cfg()  # bytes/token = 2 layers * 2 * 2 kv heads * 8 * 4 B = 256
    bpt = cfg.kv_bytes_per_token(4)
    assert bpt == 256
    plan = plan_kv(free_before, free_now, frac, cfg, 4, PAGE, granule)
    assert plan.reserve_bytes == pytest.approx((1 - frac) * free_before, abs=1)
    assert plan.kv_bytes == free_now - plan.reserve_bytes
    assert plan.ideal_tokens == plan.kv_bytes // bpt // PAGE * PAGE
    assert plan.tokens % PAGE == 0 and plan.tokens <= plan.ideal_tokens
    # the real pool (dummy page included), each tensor rounded up to the granule, fits
    per_tensor = pool_bytes(cfg, plan.tokens, PAGE, 4) // (2 * cfg.num_layers)
    assert 2 * cfg.num_layers * (-(-per_tensor // granule) * granule) <= plan.kv_bytes
    if granule == 1:
        assert plan.tokens == plan.ideal_tokens - PAGE  # only the dummy page is lost
    if plan.kv_bytes > 1000 * 2 * cfg.num_layers * granule:
        assert plan.tokens >= 0.99 * plan.ideal_tokens


def test_smallest_workable_fraction_is_the_threshold():
    free_before, free_now, need = 80 * GIB, 70 * GIB, 3 * GIB
    f = smallest_workable_fraction(free_before, free_now, need)
    assert f == pytest.approx(0.17)  # 1 - (70 - 3) / 80 = 0.1625 -> 0.17
    assert free_now - (1 - f) * free_before >= need
    assert free_now - (1 - (f - 0.01)) * free_before < need


def size(reader, free_before, weights, fraction, runner=None):
    """The start-up steps on the CPU (no graphs), one 64-token batch of eager peak."""
    model = tiny_model()
    scratch, peak = eager_peak(model, runner or EagerRunner(model), None, PAGE, 64)
    free_pre, secs = capture(None, scratch.cache, reader)
    del scratch
    report = size_kv(model.cfg, model.dtype, model.device, None, (free_before, free_pre, reader()),
                     weights, peak, secs, fraction, PAGE, 64)
    return report, plan_kv(free_before, report.free_after_capture_bytes, fraction, model.cfg,
                           model.dtype.itemsize, PAGE, 1)


def test_refuses_to_start_naming_every_term_and_the_smallest_fraction():
    free_before, free_pre, free_now = 100 * GIB, 90 * GIB, 60 * GIB
    with pytest.raises(InsufficientMemory) as e:
        size(scripted(free_pre, free_now), free_before, 8 * GIB, fraction=0.3)
    msg = str(e.value)
    for term in ("MEM_FRACTION_STATIC=0.3", "free before loading 100.00 GiB", "weights 8.00 GiB",
                 "CUDA-graph capture 30.00 GiB", "other start-up use 2.00 GiB",
                 "free after capture 60.00 GiB", "reserve (1 − 0.3) × 100.00 GiB = 70.00 GiB",
                 "KV bytes = -10.00 GiB", "smallest workable MEM_FRACTION_STATIC is 0.41"):
        assert term in msg, (term, msg)
    # and 0.41 does start
    report, plan = size(scripted(free_pre, free_now), free_before, 8 * GIB, 0.41)
    assert plan.tokens >= 64


def test_no_fraction_fits_says_what_to_change():
    with pytest.raises(InsufficientMemory, match="no MEM_FRACTION_STATIC fits"):
        size(scripted(1000, 10), 1000, 900, 0.5)


def test_warns_when_the_eager_peak_does_not_fit_the_reserve(caplog, monkeypatch):
    from service.engine.runners import capture

    monkeypatch.setattr(capture, "eager_peak_bytes", lambda device, run: 20 * GIB)
    with caplog.at_level("WARNING"):
        report, _ = size(scripted(70 * GIB, 70 * GIB), 80 * GIB, GIB, 0.85)
    assert "eager activation peak 20.00 GiB" in caplog.text and "exceeds the reserve" in caplog.text
    assert "MEM_FRACTION_STATIC ≤ 0.75" in caplog.text
    assert report.eager_peak_bytes == 20 * GIB


def test_engine_core_sizes_the_pool_from_the_reader_after_capture(caplog):
    # calls: before the weights load, before capture, after capture
    reader = scripted(100 * MIB, 90 * MIB, 87 * MIB)  # small: the CPU pool is real
    core = EngineCore(engine_cfg(mem_fraction_static=0.8), loaded=tiny_loaded(),
                      memory_reader=reader)
    m = core.memory
    assert m.free_before_bytes == 100 * MIB and m.capture_bytes == 3 * MIB
    assert m.reserve_bytes == 20 * MIB
    assert m.free_after_capture_bytes == 87 * MIB
    ideal = (m.free_after_capture_bytes - m.reserve_bytes) // 256 // PAGE * PAGE
    assert m.kv_tokens == core.pool.capacity_tokens and m.kv_tokens >= 0.99 * ideal
    assert m.kv_bytes == core.pool.nbytes <= m.free_after_capture_bytes - m.reserve_bytes
    assert m.weights_bytes > 0 and m.mem_fraction_static == 0.8 and m.path == "cpu-eager"
    assert m.retained_input_bytes == 0 and m.buckets == ()


def test_kv_pool_nbytes_formula():
    cfg = tiny_cfg()
    pool = KVPool(cfg, 100, PAGE, torch.float32, "cpu")
    assert pool.nbytes == pool_bytes(cfg, 100, PAGE, 4)


def test_kv_transfers_export_region_comes_out_of_the_kv_budget():
    """The export region is allocated after the pool; sized first, it leaves the reserve whole."""
    from service.kv_transfer.export import export_bytes

    def pool(**kw):
        return EngineCore(engine_cfg(mem_fraction_static=0.8, **kw), loaded=tiny_loaded(),
                          memory_reader=scripted(100 * MIB, 90 * MIB, 87 * MIB)).pool
    held = export_bytes(tiny_cfg(), 8192, PAGE, 4)
    plain, shared = pool(), pool(kv_transfer="nixl", kv_transfer_tokens=8192)
    assert held == (8192 // PAGE + 1) * PAGE * 256  # 256 B: a token's K and V, every layer
    assert plain.nbytes - shared.nbytes == pytest.approx(held, abs=2 * PAGE * 256)
