"""Start-up on a device: the eager peak, then every graph captured on a scratch KV pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.kv_pool import KVPool
from service.engine.memory import MemoryReader, gib
from service.engine.runners import Runner, eager_peak_bytes, on_stream
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.full import FullGraphRunner
from service.engine.runners.full_buffers import capture_chunks
from service.model.decoder import DecoderModel
from service.model.meta import KVCache

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


def settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def eager_peak(model: DecoderModel, fallback: Runner, stream: torch.cuda.Stream | None,
               page_size: int, max_tokens: int) -> tuple[KVPool, int]:
    """A scratch KV pool for capture, and the activation peak of the largest eager batch."""
    with on_stream(stream):
        scratch = KVPool(model.cfg, page_size, page_size, model.dtype, model.device)
    batch = capture_chunks(max_tokens, model.max_positions, page_size)
    with on_stream(stream):
        peak = eager_peak_bytes(model.device, lambda kv=scratch.cache: fallback.run(batch, kv))
    settle(model.device)
    return scratch, peak


def capture(graphs: Graphs | None, kv: KVCache, reader: MemoryReader) -> tuple[int, float]:
    """Capture every graph on scratch pool `kv`: (free bytes before, seconds)."""
    free_pre = reader()
    total = len(graphs.breakable.buckets) if graphs is not None else 0
    t0 = time.perf_counter()

    def progress(k: int, n: int) -> None:
        log.info("captured bucket %d tokens (%d/%d), %s free", n, k + 1, total, gib(reader()))

    if graphs is not None:
        graphs.capture(kv, on_bucket=progress)
    return free_pre, time.perf_counter() - t0
