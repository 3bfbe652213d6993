"""Launch configurations of the Triton extend-attention kernel: a hand table keyed on (capability
major, padded head_dim). No autotuning: it would run inside CUDA-graph capture."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnConfig:
    """Tiles, warps, stages; TMA from tma_min_tokens rows (descriptors cost host time); pack_gqa:
    a program's rows hold every query head of a KV head, K/V loaded once a group (`packing`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    heads_first: bool = False
    tma_min_tokens: int = 4096
    prefetch_pages: bool = True
    pack_gqa: bool = False


CONFIGS: dict[tuple[int, int], AttnConfig] = {
    (9, 64): AttnConfig(128, 64, 8, 3, heads_first=True, prefetch_pages=False),
    (9, 128): AttnConfig(128, 64, 8, 3, use_tma=True),
    (9, 256): AttnConfig(64, 64, 4, 2),
}
# (bound, config) pairs in rising order: the first whose bound covers max_q_len serves a batch
Tiers = tuple[tuple[int, AttnConfig], ...]
# With a cached prefix: <= 64 new rows a sequence (scoring's items) pack a KV group's heads, which
# read the prefix once a group (docs/performance.md, scoring's item batches); then smaller tiles.
PACKED = AttnConfig(128, 64, 8, 3, heads_first=True, pack_gqa=True)
SMALL_CONFIGS: dict[tuple[int, int], Tiers] = {
    (9, 64): ((64, PACKED), (1024, AttnConfig(64, 64, 4, 3, prefetch_pages=False))),
    (9, 128): ((64, PACKED), (256, AttnConfig(64, 32, 4, 2))),
}
# Checked first without a known cached prefix: 64-row tiles, heads first, win there but lose with
# a long prefix, which every q-block reads again (docs/performance.md#attention-kernel-vs-sdpa).
PREFIX_FREE_CONFIGS: dict[tuple[int, int], Tiers] = {
    (9, 64): ((256, AttnConfig(64, 64, 4, 2, prefetch_pages=False)),
              (1024, AttnConfig(64, 64, 4, 3, heads_first=True, prefetch_pages=False))),
    (9, 128): ((256, AttnConfig(64, 32, 4, 2)),
               (2048, AttnConfig(64, 64, 4, 3, heads_first=True))),
}
DEFAULTS = {
    64: AttnConfig(128, 64, 4, 3),
    128: AttnConfig(128, 64, 8, 3),
    256: AttnConfig(64, 32, 4, 2),
}
FP32_CONFIG = AttnConfig(64, 32, 4, 2)
INTERPRETER_CONFIG = AttnConfig(16, 16, 4, 1)


def packing(cfg: AttnConfig, group: int) -> tuple[int, int]:
    """(heads packed, positions held); below 16 positions (the dot's least K) it runs unpacked."""
    if cfg.pack_gqa and group > 1:
        rows = 1 << ((cfg.block_m // group).bit_length() - 1) if cfg.block_m >= group else 0
        if rows >= 16:
            return group, rows
    return 1, cfg.block_m


def pick_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                max_q_len: int | None = None, max_prefix_len: int | None = None,
                group: int = 1) -> AttnConfig:
    """The first tier covering `max_q_len` that fits the prefix and `group`, else the table's."""
    table, prefix_free, small = _entries(head_dim, dtype, device)
    if max_q_len is not None:
        tiers = small if max_prefix_len else prefix_free + small
        for bound, cfg in tiers:
            if max_q_len <= bound and (not cfg.pack_gqa or packing(cfg, group)[0] > 1):
                return cfg
    return table


@functools.lru_cache(maxsize=64)
def _entries(head_dim: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[AttnConfig, Tiers, Tiers]:
    if device.type != "cuda":
        return INTERPRETER_CONFIG, (), ()
    if dtype == torch.float32:
        return FP32_CONFIG, (), ()
    d_key = max(64, 1 << (head_dim - 1).bit_length())
    key = (torch.cuda.get_device_capability(device)[0], d_key)
    return (CONFIGS.get(key, DEFAULTS[d_key]), PREFIX_FREE_CONFIGS.get(key, ()),
            SMALL_CONFIGS.get(key, ()))


def prefix_batch_rows() -> tuple[int, ...]:
    """New rows after a cached prefix reaching every config such batches use (warm-up runs each)."""
    bounds = {bound for entries in SMALL_CONFIGS.values() for bound, _ in entries}
    tma = min((c.tma_min_tokens for c in CONFIGS.values() if c.use_tma), default=0)
    return tuple(sorted({16} | {b + 16 for b in bounds} | ({tma + 16} if tma else set())))
