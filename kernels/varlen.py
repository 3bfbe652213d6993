"""The metadata of a varlen extend batch, as the attention kernels take it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class VarlenBatch:
    """B sequences packed token-major; optional host-side facts (None: unknown) pick faster code."""

    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    prefix_lens: torch.Tensor  # (B,) int32: cached tokens before each sequence's new tokens
    page_table: torch.Tensor  # (B, W) int32: page ids covering each prefix
    page_size: int
    max_q_len: int  # >= the longest sequence's new-token count
    max_prefix_len: int | None = None
    num_tokens: int | None = None
