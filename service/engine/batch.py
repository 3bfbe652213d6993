"""A prefill batch: the sequences of one forward, flattened into ids, positions and metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.pages import DUMMY_SLOT, page_table_tensor, slots_for
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

    chunks: tuple[SeqChunk, ...]
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
    ps = kv.page_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    logits_idx: list[int] = []
    rows: list[tuple[int, int]] = []
    for c in chunks:
        start = len(ids)
        ids.extend(c.token_ids)
        pos.extend(range(c.prefix_len, c.prefix_len + c.num_tokens))
        slots.extend(slots_for(list(c.pages), c.prefix_len, c.num_tokens, ps))
        cu.append(len(ids))
        first = len(logits_idx)
        if c.all_logits:
            logits_idx.extend(range(start, len(ids)))
        elif c.num_tokens:
            logits_idx.append(len(ids) - 1)
        rows.append((first, len(logits_idx)))
    t = len(ids)
    padded = max(pad_to or t, t)
    pad = padded - t
    ids += [0] * pad
    pos += [0] * pad
    slots += [DUMMY_SLOT] * pad

    def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    meta = ForwardMeta(
        cu_seqlens_q=dev(cu, torch.int32),
        prefix_lens=dev([c.prefix_len for c in chunks], torch.int32),
        page_table=page_table_tensor([list(c.pages) for c in chunks], device),
        slot_mapping=dev(slots, torch.int64),
        logits_indices=dev(logits_idx, torch.int64),
        q_lens=tuple(c.num_tokens for c in chunks),
        prefix_lens_host=tuple(c.prefix_len for c in chunks),
        kv=kv,
    )
    return PrefillBatch(tuple(chunks), dev(ids, torch.int64), dev(pos, torch.int64), meta,
                        tuple(rows))
