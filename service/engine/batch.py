"""A prefill batch: the sequences of one forward, flattened into ids, positions and metadata."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.host_copy import HostCopy
from service.engine.pages import DUMMY_SLOT, flatten_pages, page_table_array, token_slots
from service.engine.runners.packing import Packing
from service.model.meta import ForwardMeta, KVCache


def token_array(token_ids) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class SeqChunk:
    """One sequence's share of a forward: `ids` are new; `prefix_len` tokens are cached."""

    ids: np.ndarray
    prefix_len: int
    pages: tuple[int, ...]
    all_logits: bool = False  # logits for every new token (prompt logprobs), not only the last
    named: tuple[int, ...] = ()  # tokens whose logprobs at the last row the forward reduces
    hidden: bool = False  # its last row's final-norm hidden state goes to the host
    pool: str = ""  # mean: the sum of its final-norm rows goes to the host; cls: its first row
    head: bool = False  # with `hidden`: the score head's logits of that row go instead

    def __post_init__(self) -> None:
        if not (isinstance(self.ids, np.ndarray) and self.ids.dtype == np.int64):
            object.__setattr__(self, "ids", token_array(self.ids))
        if not isinstance(self.pages, tuple):
            object.__setattr__(self, "pages", tuple(self.pages))

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.ids.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SeqChunk):
            return NotImplemented
        return (self.prefix_len, self.pages, self.all_logits, self.named, self.hidden,
                self.pool, self.head) == (other.prefix_len, other.pages, other.all_logits,
                                          other.named, other.hidden, other.pool, other.head
                                          ) and np.array_equal(self.ids, other.ids)


@dataclass(frozen=True)
class PrefillBatch:
    """Owns the flat tensors of one forward. `input_ids`/`positions` may be padded past T."""

    input_ids: torch.Tensor  # (T_padded,) int64
    positions: torch.Tensor  # (T_padded,) int64
    meta: ForwardMeta
    logits_rows: tuple[tuple[int, int], ...]  # per chunk: [start, end) into the logits rows
    last_rows: torch.Tensor  # (B,) int64 on the device: each chunk's last row of the logits
    summary: HostCopy | None = None  # (B, summary_width) when a full graph reduced the last rows
    layout: tuple | None = None  # when staged: equal layouts share device addresses
    hidden: torch.Tensor | None = None  # (logits rows, hidden) the head's normed rows, if asked
    pooled: torch.Tensor | None = None  # (chunks asking `pool`, hidden) fp32

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class HostBatch:
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
    if t:
        np.concatenate([c.ids for c in chunks], out=ids[:t])
    page_lists = [c.pages for c in chunks]
    flat = flatten_pages(page_lists)
    pos[:t], slots[:t] = token_slots(page_lists, prefix, counts, page_size, flat)
    if any(c.all_logits for c in chunks):
        logits_idx: list[int] = []
        ends: list[int] = []
        for c, start, end in zip(chunks, cu[:-1].tolist(), cu[1:].tolist()):
            if c.all_logits:
                logits_idx.extend(range(start, end))
            elif end > start:
                logits_idx.append(end - 1)
            ends.append(len(logits_idx))
        idx, row_ends = np.asarray(logits_idx, np.int64), np.asarray(ends, np.int64)
    else:
        live = counts > 0
        idx, row_ends = cu[1:][live] - 1, np.cumsum(live)
    starts = np.zeros(b, np.int64)
    starts[1:] = row_ends[:-1]
    return HostBatch(
        ids=ids, positions=pos, slots=slots, cu=cu, prefix=prefix,
        table=page_table_array(page_lists, flat), logits_idx=idx,
        last_idx=np.maximum(row_ends - 1, 0),
        logits_rows=tuple(zip(starts.tolist(), row_ends.tolist())),
        q_lens=tuple(counts.tolist()), prefix_lens=tuple(prefix.tolist()))


def packing(key: tuple[int, int, int, int]) -> Packing:
    """Layout of shape (t padded tokens, n logit rows, b sequences, w page-table width)."""
    t, n, b, w = key
    return Packing.of((t, t, t, n, b), (b + 1, b, b * w))


def _views(p: Packing, words, key: tuple[int, int, int, int]) -> tuple:
    *parts, table = p.cut(words)
    return (*parts, table.reshape(key[2], key[3]))


def _fill(h: HostBatch, host: tuple) -> None:
    for dst, src in zip(host, (h.ids, h.positions, h.slots, h.logits_idx, h.last_idx, h.cu,
                               h.prefix, h.table)):
        dst[...] = src


def build_batch(chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache,
                device: torch.device | str, pad_to: int | None = None,
                staging: BatchStaging | None = None) -> PrefillBatch:
    h = host_batch(chunks, kv.page_size, pad_to)
    key = (h.ids.size, h.logits_idx.size, len(h.q_lens), h.table.shape[1])
    if staging is not None:
        dev = staging.stage(h, key)
    else:
        device = torch.device(device)
        p = packing(key)
        words = torch.empty(p.words, dtype=torch.int64, pin_memory=device.type == "cuda")
        _fill(h, _views(p, words.numpy(), key))
        # NOTE: an async copy; the caching host allocator keeps `words` until it finishes
        dev = _views(p, words.to(device, non_blocking=True), key)
    ids, pos, slots, logits, last, cu, prefix, table = dev
    meta = ForwardMeta(cu_seqlens_q=cu, prefix_lens=prefix, page_table=table,
                       slot_mapping=slots, logits_indices=logits, q_lens=h.q_lens,
                       prefix_lens_host=h.prefix_lens, kv=kv)
    return PrefillBatch(ids, pos, meta, h.logits_rows, last,
                        layout=(id(staging), staging.generation, key) if staging else None)


class BatchStaging:
    """Reused buffers: addresses fixed per shape, valid only until the next batch is staged."""

    MAX_SHAPES = 256

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.generation = 0
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=self.device)
        self._cuda = self.device.type == "cuda"
        self._copied = torch.cuda.Event() if self._cuda else None
        self._views: dict[tuple, tuple] = {}

    def stage(self, h: HostBatch, key: tuple[int, int, int, int]) -> tuple:
        """Fill the pinned buffer with `h`, queue its copy on the current stream; device views."""
        host, dev, dst, src = self._views.get(key) or self._cut(key)
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copy has left the buffer
        _fill(h, host)
        dst.copy_(src, non_blocking=self._cuda)
        if self._copied is not None:
            self._copied.record()
        return dev

    def _cut(self, key: tuple[int, int, int, int]) -> tuple:
        p = packing(key)
        if p.words > self._dev.numel():  # grow (the old buffers live on in earlier batches)
            size = max(p.words, 2 * self._dev.numel(), 1 << 14)
            if self._copied is not None:
                self._copied.synchronize()
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=self._cuda)
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
            self._views.clear()
            self.generation += 1
        if len(self._views) >= self.MAX_SHAPES:
            self._views.clear()
        cut = (_views(p, self._host.numpy(), key), _views(p, self._dev, key),
               self._dev[:p.words], self._host[:p.words])
        self._views[key] = cut
        return cut
