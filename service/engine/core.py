"""EngineCore: load → (capture) → size the KV pool → forward batches. No HTTP, no metrics here.

The scheduler drives it from one worker thread; everything it exposes for metrics is plain
numbers (`MemoryReport`, `forward_counts`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from service.config import EngineConfig
from service.engine.batch import SeqChunk, build_batch
from service.engine.kv_pool import KVPool
from service.model.loader import load_model

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class MemoryReport:
    """Every term of the memory budget, in bytes (plain numbers for /info and /metrics)."""

    free_before_bytes: int
    weights_bytes: int
    capture_bytes: int
    retained_input_bytes: int
    kv_bytes: int
    kv_tokens: int
    reserve_bytes: int
    eager_peak_bytes: int
    mem_fraction_static: float
    capture_seconds: float
    buckets: tuple[int, ...] = field(default_factory=tuple)


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor]  # per chunk: (rows, vocab) fp32 on the CPU
    mode: str  # "graph" | "eager"
    seconds: float


def weights_nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = _DTYPES[cfg.dtype]
        loaded = load_model(cfg.model_path, self.device, self.dtype)
        self.model, self.tokenizer, self.model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self.model_path = str(loaded.path)
        self.load_seconds = loaded.load_seconds
        bpt = self.model_cfg.kv_bytes_per_token(self.dtype.itemsize)
        kv_tokens = max(cfg.kv_cache_bytes // bpt, 2 * cfg.page_size)
        self.pool = KVPool(self.model_cfg, kv_tokens, cfg.page_size, self.dtype, self.device)
        self.memory = MemoryReport(
            free_before_bytes=0, weights_bytes=weights_nbytes(self.model), capture_bytes=0,
            retained_input_bytes=0, kv_bytes=self.pool.nbytes,
            kv_tokens=self.pool.capacity_tokens, reserve_bytes=0, eager_peak_bytes=0,
            mem_fraction_static=cfg.mem_fraction_static, capture_seconds=0.0)
        self.forward_counts = {"graph": 0, "eager": 0}
        log.info("engine ready on %s (eager, reference attention): KV pool %d tokens (%d bytes)",
                 self.device, self.pool.capacity_tokens, self.pool.nbytes)

    @property
    def max_batch_tokens(self) -> int:
        return self.cfg.max_prefill_tokens

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> ForwardOutput:
        t0 = time.perf_counter()
        batch = build_batch(chunks, self.pool.cache, self.device)
        logits = self.model(batch.input_ids, batch.positions, batch.meta).cpu()
        self.forward_counts["eager"] += 1
        return ForwardOutput([logits[s:e] for s, e in batch.logits_rows], "eager",
                             time.perf_counter() - t0)

    def close(self) -> None:
        pass
