"""The model's one metadata input: where each sequence's new tokens sit and where its KV lives."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.varlen import VarlenBatch


@dataclass
class KVCache:
    """Per-layer K and V pools, each (num_slots, kv_heads, head_dim); slot 0 takes padding."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int


    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class KVAddresses:
    """K/V pool addresses as device data, so full graphs can run on a pool allocated later."""

    def __init__(self, layers: int, device: torch.device | str):
        self.table = torch.zeros(2, layers, 2, dtype=torch.int64, device=device)
        self.rows = [(self.table[0, i, :1], self.table[1, i, :1]) for i in range(layers)]
        self.kv: KVCache | None = None

    def bind(self, kv: KVCache) -> None:
        if kv is self.kv:
            return
        layers = self.table.shape[1]
        assert len(kv.k) == layers, f"a pool of {len(kv.k)} layers for a table of {layers}"
        addrs = [[(t.data_ptr(), 0) for t in kv.k], [(t.data_ptr(), 0) for t in kv.v]]
        assert all(a % 16 == 0 for row in addrs for a, _ in row), "caches must be 16-B aligned"
        self.table.copy_(torch.tensor(addrs, dtype=torch.int64))
        self.kv = kv

    def unbind(self) -> None:
        """Drop the bound pool; NOTE: the table keeps stale addresses until the next bind."""
        self.kv = None


@dataclass(frozen=True)
class ForwardMeta:
    """A flat varlen batch of B sequences, T real tokens; tuples serve host code without a sync."""

    cu_seqlens_q: torch.Tensor  # (B+1,) int32: new tokens of sequence b are [cu[b], cu[b+1])
    prefix_lens: torch.Tensor  # (B,) int32: cached tokens before each sequence's new tokens
    page_table: torch.Tensor  # (B, max_pages) int32: page ids covering prefix + new tokens
    slot_mapping: torch.Tensor  # (T_padded,) int64: KV slot per token; padding -> slot 0
    logits_indices: torch.Tensor  # (N,) int64: token rows whose logits are computed
    q_lens: tuple[int, ...]
    prefix_lens_host: tuple[int, ...]
    kv: KVCache

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_prefix_len(self) -> int:
        return max(self.prefix_lens_host, default=0)

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @cached_property
    def varlen(self) -> VarlenBatch:
        return VarlenBatch(self.cu_seqlens_q, self.prefix_lens, self.page_table, self.page_size,
                           self.max_q_len, self.max_prefix_len, self.num_tokens)
