"""A prefill batch: the sequences of one forward, flattened into ids, positions and metadata."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from service.engine.pages import DUMMY_SLOT, page_table_tensor, token_slots
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

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_batch(chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache,
                device: torch.device | str, pad_to: int | None = None) -> PrefillBatch:
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
    pos[:t], slots[:t] = token_slots([c.pages for c in chunks], prefix, counts, kv.page_size)
    logits_idx: list[int] = []
    rows: list[tuple[int, int]] = []
    for c, start, end in zip(chunks, cu[:-1].tolist(), cu[1:].tolist()):
        first = len(logits_idx)
        if c.all_logits:
            logits_idx.extend(range(start, end))
        elif end > start:
            logits_idx.append(end - 1)
        rows.append((first, len(logits_idx)))

    def dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(x).to(device=device, dtype=dtype, non_blocking=True)

    meta = ForwardMeta(
        cu_seqlens_q=dev(cu, torch.int32),
        prefix_lens=dev(prefix, torch.int32),
        page_table=page_table_tensor([c.pages for c in chunks], device),
        slot_mapping=dev(slots, torch.int64),
        logits_indices=dev(np.asarray(logits_idx, np.int64), torch.int64),
        q_lens=tuple(counts.tolist()),
        prefix_lens_host=tuple(prefix.tolist()),
        kv=kv,
    )
    return PrefillBatch(dev(ids, torch.int64), dev(pos, torch.int64), meta, tuple(rows))
