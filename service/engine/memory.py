"""KV sizing, SGLang's way: free after capture − (1 − MEM_FRACTION_STATIC) × free before load."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from service.engine.interface import MemoryReport
from service.engine.pages import pages_for
from service.model.config import ModelConfig

if TYPE_CHECKING:
    from service.engine.runners.capture import Graphs

log = logging.getLogger(__name__)
MemoryReader = Callable[[], int]
ALLOC_GRANULE = 2 << 20  # the CUDA caching allocator rounds large blocks up to 2 MiB
GIB = float(1 << 30)


class InsufficientMemory(Exception):
    """MEM_FRACTION_STATIC leaves no room for the KV pool after weights and graphs."""


def cuda_free_bytes(device: torch.device | str) -> MemoryReader:
    return lambda: torch.cuda.mem_get_info(device)[0]


def gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


@dataclass(frozen=True)
class KVPlan:
    reserve_bytes: int
    kv_bytes: int
    ideal_tokens: int
    tokens: int  # what the pool gets: less the dummy page and the allocator's block rounding


def plan_kv(free_before: int, free_now: int, fraction: float, cfg: ModelConfig,
            dtype_bytes: int, page_size: int, granule: int = ALLOC_GRANULE) -> KVPlan:
    """KV budget after capture; `tokens` accounts for the dummy page and `granule` rounding."""
    reserve = math.ceil((1.0 - fraction) * free_before - 1e-6)  # never under-reserve
    kv_bytes = free_now - reserve
    bpt = cfg.kv_bytes_per_token(dtype_bytes)
    ideal = max(kv_bytes, 0) // bpt // page_size * page_size
    per_tensor = max(kv_bytes, 0) // (2 * cfg.num_layers) // granule * granule
    slots = per_tensor // (cfg.num_kv_heads * cfg.head_dim * dtype_bytes)
    tokens = max(slots // page_size - 1, 0) * page_size
    return KVPlan(reserve, kv_bytes, ideal, tokens)


def smallest_workable_fraction(free_before: int, free_now: int, need_bytes: int) -> float:
    """Smallest MEM_FRACTION_STATIC (2 decimals, rounded up) leaving `need_bytes` for KV."""
    f = 1.0 - (free_now - need_bytes) / max(free_before, 1)
    return math.ceil(f * 100 - 1e-9) / 100


def refuse_message(plan: KVPlan, fraction: float, free_before: int, free_now: int,
                   weights: int, capture: int, need_bytes: int, need_tokens: int) -> str:
    other = free_before - free_now - weights - capture
    f_min = smallest_workable_fraction(free_before, free_now, need_bytes)
    advice = (f"the smallest workable MEM_FRACTION_STATIC is {f_min:.2f} (room for one "
              f"{need_tokens}-token batch of KV)" if f_min < 1.0 else
              "no MEM_FRACTION_STATIC fits: lower CUDA_GRAPH_MAX_TOKENS or MAX_PREFILL_TOKENS, "
              "or use a smaller model or a larger GPU")
    return (f"MEM_FRACTION_STATIC={fraction} leaves no memory for the KV pool: free before "
            f"loading {gib(free_before)}, weights {gib(weights)}, CUDA-graph capture "
            f"{gib(capture)}, other start-up use {gib(other)}, free after capture "
            f"{gib(free_now)}, reserve (1 − {fraction}) × {gib(free_before)} = "
            f"{gib(plan.reserve_bytes)}, so KV bytes = {gib(plan.kv_bytes)}; {advice}")


def cpu_kv_tokens(cfg: ModelConfig, dtype_bytes: int, page_size: int, context: int,
                  kv_cache_bytes: int | None) -> int:
    """KV pool tokens without a memory reader: KV_CACHE_BYTES, else two longest prompts."""
    if kv_cache_bytes is None:
        return 2 * pages_for(context, page_size) * page_size
    bpt = cfg.kv_bytes_per_token(dtype_bytes)
    return max(kv_cache_bytes // bpt // page_size - 1, 2) * page_size


def cpu_report(weights: int, fraction: float, kv_tokens: int) -> MemoryReport:
    return MemoryReport(free_before_bytes=0, weights_bytes=weights, capture_bytes=0,
                        retained_input_bytes=0, kv_bytes=0, kv_tokens=kv_tokens,
                        reserve_bytes=0, eager_peak_bytes=0, mem_fraction_static=fraction,
                        capture_seconds=0.0, path="cpu")


def size_kv(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, graphs: Graphs | None,
            free: tuple[int, int, int], weights: int, eager_peak: int, capture_s: float,
            fraction: float, page_size: int, max_prefill_tokens: int) -> MemoryReport:
    """The KV budget from `free` (before loading, before and after capture), or refuse."""
    free_before, free_pre, free_now = free
    capture = free_pre - free_now
    granule = ALLOC_GRANULE if device.type == "cuda" else 1
    plan = plan_kv(free_before, free_now, fraction, cfg, dtype.itemsize, page_size, granule)
    if graphs is not None:
        log.info("captured %d buckets (%d graphs) in %.2fs: capture memory %s (static buffers "
                 "%s), retained capture inputs %d B, eager activation peak %s",
                 len(graphs.breakable.buckets), graphs.num_graphs, capture_s, gib(capture),
                 gib(graphs.static_bytes), graphs.retained_bytes, gib(eager_peak))
    if plan.tokens < page_size:
        need_tokens = max_prefill_tokens + page_size
        need = need_tokens * cfg.kv_bytes_per_token(dtype.itemsize) + 2 * cfg.num_layers * (
            ALLOC_GRANULE + page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize)
        raise InsufficientMemory(refuse_message(plan, fraction, free_before, free_now,
                                                weights, capture, need, max_prefill_tokens))
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
    return MemoryReport(
        free_before_bytes=free_before, weights_bytes=weights, capture_bytes=capture,
        retained_input_bytes=graphs.retained_bytes if graphs else 0, kv_bytes=0,
        kv_tokens=plan.tokens, reserve_bytes=plan.reserve_bytes, eager_peak_bytes=eager_peak,
        mem_fraction_static=fraction, capture_seconds=capture_s,
        buckets=graphs.buckets if graphs else (), free_after_capture_bytes=free_now,
        static_buffer_bytes=graphs.static_bytes if graphs else 0,
        graphs=graphs.num_graphs if graphs else 0,
        path="cuda-graphs" if captured else f"{device.type}-eager",
        full_buckets=graphs.full_buckets if graphs else ())
