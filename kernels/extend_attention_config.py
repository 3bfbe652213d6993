"""Launch configurations of the extend-attention kernel: a small hand table, no autotuning.

Autotuning is avoided on purpose: it would run inside CUDA-graph capture and on the latency path.
The table is keyed on (device capability major, head_dim padded to >= 64) for bf16/fp16 and was
picked from bench/attention.py on an H200 (bench/results/attention.md); edit it after re-running
that benchmark on another GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnConfig:
    """Tiles, warps and pipeline depth, plus the optional code paths of the kernel.

    use_tma: TMA (tensor-descriptor) loads for the unmasked new-token blocks (Hopper+; ignored
      for fp32 and padded D), used only when the batch has >= tma_min_tokens rows: building the
      descriptors costs ~55 us of host time per launch, more than TMA saves on small batches.
    heads_first: grid (H, q-blocks, B) instead of (q-blocks, H, B): the longest q-blocks of all
      heads start first.
    prefetch_pages: load the next prefix block's page ids one block early.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    heads_first: bool = False
    tma_min_tokens: int = 4096
    prefetch_pages: bool = True


# H200, bench/results/attention-h200-2026-11-29*.md (TFLOP/s, causal 32q/8kv heads, 4k / 16k):
# D=64 heads-first 397 / 446 against 333 / 422 for the (q-blocks, H, B) grid; with page-id
# prefetch on, one run measured 294 / 344 (cause not isolated), so D=64 keeps it off until a
# bench run with the -nopf variants says otherwise. D=128: TMA 412 / 515 against 388 / 484 plain,
# and prefetch lifts "1k new on 8k cached" from 264 to 392-414 (SDPA flash 332, cuDNN 291).
# BLOCK_N 128 and 4-warp variants lost everywhere.
CONFIGS: dict[tuple[int, int], AttnConfig] = {
    (9, 64): AttnConfig(128, 64, 8, 3, heads_first=True, prefetch_pages=False),
    (9, 128): AttnConfig(128, 64, 8, 3, use_tma=True),
    (9, 256): AttnConfig(64, 64, 4, 2),
}
# Batches whose longest sequence has at most `bound` new tokens (the full graphs' buckets, small
# breakable ones): 64-row tiles give short batches more programs. H200, bench/results/
# small-attention-*.md, one prefix-free prompt of 128 / 512 / 1,024 tokens, us per launch, table
# config vs this: 9q/3kv D64 5.9 / 11 / 17 vs 4.1 / 7.3 / 14; 32q/8kv D128 9.9 vs 6.3 at 128
# (at 512 / 1,024 only 16 / 42 vs 16 / 38: D128 keeps its table entry there, whose page-id
# prefetch and TMA the long-prefix extend case was tuned with).
SMALL_CONFIGS: dict[tuple[int, int], tuple[tuple[int, AttnConfig], ...]] = {
    (9, 64): ((1024, AttnConfig(64, 64, 4, 3, prefetch_pages=False)),),
    (9, 128): ((256, AttnConfig(64, 32, 4, 2)),),
}
DEFAULTS = {
    64: AttnConfig(128, 64, 4, 3),
    128: AttnConfig(128, 64, 8, 3),
    256: AttnConfig(64, 32, 4, 2),
}
FP32_CONFIG = AttnConfig(64, 32, 4, 2)
INTERPRETER_CONFIG = AttnConfig(16, 16, 4, 1)


def pick_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                max_q_len: int | None = None) -> AttnConfig:
    """The table entry for this head_dim, dtype and device (interpreter: the smallest tiles);
    with `max_q_len` (the longest sequence's new tokens, or a bound), the small-batch entry
    where one covers it."""
    table, small = _entries(head_dim, dtype, device)
    if max_q_len is not None:
        for bound, cfg in small:
            if max_q_len <= bound:
                return cfg
    return table


@functools.lru_cache(maxsize=64)
def _entries(head_dim: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[AttnConfig, tuple[tuple[int, AttnConfig], ...]]:
    if device.type != "cuda":
        return INTERPRETER_CONFIG, ()
    if dtype == torch.float32:
        return FP32_CONFIG, ()
    d_key = max(64, 1 << (head_dim - 1).bit_length())
    major, _ = torch.cuda.get_device_capability(device)
    return CONFIGS.get((major, d_key), DEFAULTS[d_key]), SMALL_CONFIGS.get((major, d_key), ())


def tile_thresholds() -> tuple[int, int]:
    """(the largest max_q_len a small-batch entry covers, the smallest row count at which a
    table entry reads with TMA): batches on either side of each compile different kernels, so
    a warm-up that should reach them all sizes its prompts from these (EngineCore.warm_up)."""
    small = max((bound for entries in SMALL_CONFIGS.values() for bound, _ in entries), default=0)
    tma = min((c.tma_min_tokens for c in CONFIGS.values() if c.use_tma), default=0)
    return small, tma
