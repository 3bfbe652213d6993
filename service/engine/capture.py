"""Start-up on CUDA: eager peak, capture every graph (on a scratch pool), then size the KV pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.full_buffers import capture_chunks
from service.engine.interface import MemoryReport
from service.engine.kv_pool import KVPool
from service.engine.memory import (
    ALLOC_GRANULE,
    InsufficientMemory,
    KVPlan,
    MemoryReader,
    gib,
    plan_kv,
    refuse_message,
)
from service.engine.runners import Runner, eager_peak_bytes, on_stream
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.full import FullGraphRunner
from service.model.decoder import DecoderModel

log = logging.getLogger(__name__)


@dataclass
class Graphs:
    breakable: BreakableRunner
    full: FullGraphRunner | None = None

    def capture(self, kv, on_bucket: Callable[[int, int], None] | None = None) -> None:  # noqa: ANN001
        self.breakable.capture(kv, on_bucket)
        if self.full is not None:
            self.full.capture(kv)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.breakable.captured

    @property
    def full_buckets(self) -> tuple[int, ...]:
        return self.full.captured if self.full is not None else ()

    @property
    def num_graphs(self) -> int:
        return self.breakable.backend.num_graphs

    @property
    def static_bytes(self) -> int:
        full = self.full.static_bytes if self.full is not None else 0
        return self.breakable.static_bytes + full

    @property
    def retained_bytes(self) -> int:
        return self.breakable.backend.retained_bytes()

    def close(self) -> None:
        if self.full is not None:
            self.full.close()
        self.breakable.close()
        self.breakable.backend.close()


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def capture_and_size(model: DecoderModel, graphs: Graphs | None, fallback: Runner,
                     stream: torch.cuda.Stream | None, reader: MemoryReader, free_before: int,
                     weights_bytes: int, fraction: float, page_size: int,
                     max_prefill_tokens: int) -> tuple[MemoryReport, KVPlan]:
    """Measure the eager peak, capture, plan the KV pool; InsufficientMemory if it gets nothing."""
    cfg, dtype = model.cfg, model.dtype
    device = model.device
    with on_stream(stream):
        scratch = KVPool(cfg, page_size, page_size, dtype, device)
    batch = capture_chunks(max_prefill_tokens, model.max_positions, page_size)
    with on_stream(stream):
        eager_peak = eager_peak_bytes(device, lambda kv=scratch.cache: fallback.run(batch, kv))
    _settle(device)
    free_pre = reader()
    total = len(graphs.breakable.buckets) if graphs is not None else 0
    t0 = time.perf_counter()

    def progress(k: int, n: int) -> None:
        log.info("captured bucket %d tokens (%d/%d), %s free", n, k + 1, total, gib(reader()))

    if graphs is not None:
        graphs.capture(scratch.cache, on_bucket=progress)
    capture_s = time.perf_counter() - t0
    del scratch
    _settle(device)
    free_now = reader()
    capture = free_pre - free_now
    granule = ALLOC_GRANULE if device.type == "cuda" else 1
    plan = plan_kv(free_before, free_now, fraction, cfg, dtype.itemsize, page_size, granule)
    if graphs is not None:
        log.info("captured %d buckets (%d graphs) in %.2fs: capture memory %s (static buffers "
                 "%s), retained capture inputs %d B, eager activation peak %s", total,
                 graphs.num_graphs, capture_s, gib(capture), gib(graphs.static_bytes),
                 graphs.retained_bytes, gib(eager_peak))
    if plan.tokens < page_size:
        need_tokens = max_prefill_tokens + page_size
        need = need_tokens * cfg.kv_bytes_per_token(dtype.itemsize) + 2 * cfg.num_layers * (
            ALLOC_GRANULE + page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize)
        raise InsufficientMemory(refuse_message(plan, fraction, free_before, free_now,
                                                weights_bytes, capture, need, max_prefill_tokens))
    if eager_peak > plan.reserve_bytes:
        log.warning("the eager activation peak %s (one %d-token batch) exceeds the reserve %s = "
                    "(1 − MEM_FRACTION_STATIC) × free memory: a batch that size can run out of "
                    "memory; use MEM_FRACTION_STATIC ≤ %.2f or a smaller MAX_PREFILL_TOKENS",
                    gib(eager_peak), max_prefill_tokens, gib(plan.reserve_bytes),
                    1.0 - eager_peak / max(free_before, 1))
    if plan.tokens < max_prefill_tokens:
        log.warning("the KV pool holds %d tokens, less than one %d-token batch",
                    plan.tokens, max_prefill_tokens)
    captured = graphs is not None and bool(graphs.buckets)
    report = MemoryReport(
        free_before_bytes=free_before, weights_bytes=weights_bytes, capture_bytes=capture,
        retained_input_bytes=graphs.retained_bytes if graphs else 0, kv_bytes=0,
        kv_tokens=plan.tokens, reserve_bytes=plan.reserve_bytes, eager_peak_bytes=eager_peak,
        mem_fraction_static=fraction, capture_seconds=capture_s,
        buckets=graphs.buckets if graphs else (), free_after_capture_bytes=free_now,
        static_buffer_bytes=graphs.static_bytes if graphs else 0,
        graphs=graphs.num_graphs if graphs else 0,
        path="cuda-graphs" if captured else f"{device.type}-eager",
        full_buckets=graphs.full_buckets if graphs else ())
    return report, plan
