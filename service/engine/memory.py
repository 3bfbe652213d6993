"""Post-capture KV sizing with SGLang's meaning of MEM_FRACTION_STATIC: the KV pool gets
free_after_capture − (1 − MEM_FRACTION_STATIC) × free_before_weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.model.config import ModelConfig

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
    kv_bytes: int  # the formula: free_now − reserve
    ideal_tokens: int  # kv_bytes // bytes_per_token, rounded down to whole pages
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
