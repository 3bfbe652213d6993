"""A prefill batch: the sequences of one forward, flattened into ids, positions and metadata."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from service.engine.pages import DUMMY_SLOT, page_table_array, token_slots
from service.model.meta import ForwardMeta, KVCache


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward: `token_ids` are new; `prefix_len` tokens are cached."""

    token_ids: tuple[int, ...]
    prefix_len: int
    pages: tuple[int, ...]  # pages covering prefix_len + len(token_ids) tokens
    all_logits: bool = False  # logits for every new token (prompt logprobs), not only the last

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PrefillBatch:
    """Owns the flat tensors of one forward. `input_ids`/`positions` may be padded past T."""

    input_ids: torch.Tensor  # (T_padded,) int64
    positions: torch.Tensor  # (T_padded,) int64
    meta: ForwardMeta
    logits_rows: tuple[tuple[int, int], ...]  # per chunk: [start, end) into the logits rows
    last_rows: torch.Tensor  # (B,) int64 on the device: each chunk's last row of the logits
    # (B, summary_width) float64 on the host, when the forward already reduced the last rows
    # (a full graph: service.engine.sampling.summarize), else None
    summary: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class HostBatch:
    """A batch's flat arrays on the host, before they cross to the device."""

    ids: np.ndarray  # (T_padded,) int64
    positions: np.ndarray  # (T_padded,) int64
    slots: np.ndarray  # (T_padded,) int64; padding -> DUMMY_SLOT
    cu: np.ndarray  # (B + 1,) int64
    prefix: np.ndarray  # (B,) int64
    table: np.ndarray  # (B, max_pages) int32
    logits_idx: np.ndarray  # (N,) int64
    last_idx: np.ndarray  # (B,) int64
    logits_rows: tuple[tuple[int, int], ...]
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]


def host_batch(chunks: list[SeqChunk] | tuple[SeqChunk, ...], page_size: int,
               pad_to: int | None = None) -> HostBatch:
    """Flatten chunks; pad ids/positions/slots to `pad_to` (padding writes KV to the dummy slot)."""
    b = len(chunks)
    counts = np.fromiter((c.num_tokens for c in chunks), np.int64, b)
    prefix = np.fromiter((c.prefix_len for c in chunks), np.int64, b)
    cu = np.zeros(b + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    t = int(cu[-1])
    padded = max(pad_to or t, t)
    ids = np.zeros(padded, np.int64)
    pos = np.zeros(padded, np.int64)
    slots = np.full(padded, DUMMY_SLOT, np.int64)
    ids[:t] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, t)
    pos[:t], slots[:t] = token_slots([c.pages for c in chunks], prefix, counts, page_size)
    logits_idx: list[int] = []
    rows: list[tuple[int, int]] = []
    for c, start, end in zip(chunks, cu[:-1].tolist(), cu[1:].tolist()):
        first = len(logits_idx)
        if c.all_logits:
            logits_idx.extend(range(start, end))
        elif end > start:
            logits_idx.append(end - 1)
        rows.append((first, len(logits_idx)))
    return HostBatch(
        ids=ids, positions=pos, slots=slots, cu=cu, prefix=prefix,
        table=page_table_array([c.pages for c in chunks]),
        logits_idx=np.asarray(logits_idx, np.int64),
        last_idx=np.asarray([max(e - 1, 0) for _, e in rows], np.int64),
        logits_rows=tuple(rows), q_lens=tuple(counts.tolist()),
        prefix_lens=tuple(prefix.tolist()))


def build_batch(chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache,
                device: torch.device | str, pad_to: int | None = None) -> PrefillBatch:
    """Flatten chunks onto the device; pad ids/positions/slots to `pad_to`."""
    h = host_batch(chunks, kv.page_size, pad_to)
    # One host buffer per dtype and one copy each, instead of seven small pageable copies
    # (~10 us of host time apiece on the H200's host, before the first kernel can start).
    # Segments start 16-byte aligned, as separate allocations would.
    i64 = _Pack(np.int64, 2)
    ids_at, pos_at, slots_at = i64.add(h.ids), i64.add(h.positions), i64.add(h.slots)
    logits_at, last_at = i64.add(h.logits_idx), i64.add(h.last_idx)
    i32 = _Pack(np.int32, 4)
    cu_at, prefix_at, table_at = i32.add(h.cu), i32.add(h.prefix), i32.add(h.table.reshape(-1))
    d64, d32 = i64.to(device), i32.to(device)
    meta = ForwardMeta(
        cu_seqlens_q=d32[cu_at],
        prefix_lens=d32[prefix_at],
        page_table=d32[table_at].view(h.table.shape),
        slot_mapping=d64[slots_at],
        logits_indices=d64[logits_at],
        q_lens=h.q_lens,
        prefix_lens_host=h.prefix_lens,
        kv=kv,
    )
    return PrefillBatch(d64[ids_at], d64[pos_at], meta, h.logits_rows, d64[last_at])


class _Pack:
    """Arrays of one dtype laid end to end, each `align` elements aligned, then one transfer."""

    TORCH = {np.int64: torch.int64, np.int32: torch.int32}

    def __init__(self, dtype: type, align: int):
        self.dtype, self.align = dtype, align
        self.parts: list[tuple[int, np.ndarray]] = []
        self.size = 0

    def add(self, x: np.ndarray) -> slice:
        start = -(-self.size // self.align) * self.align
        self.parts.append((start, x))
        self.size = start + x.size
        return slice(start, self.size)

    def to(self, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device)
        host = torch.empty(max(self.size, 1), dtype=self.TORCH[self.dtype],
                           pin_memory=device.type == "cuda")
        buf = host.numpy()
        for start, x in self.parts:
            buf[start:start + x.size] = x
        # NOTE: non_blocking from pinned memory is a true async copy; the caching host allocator
        # keeps `host` from being reused until the copy has finished.
        return host.to(device, non_blocking=True)
