"""The fixed-address buffers a full CUDA graph reads and writes; `stage` is ONE copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.batch import PrefillBatch, SeqChunk
from service.engine.host_copy import HostCopy
from service.engine.pages import DUMMY_SLOT, pages_for
from service.engine.runners.packing import Packing
from service.engine.sampling import summary_width
from service.model.meta import ForwardMeta, KVCache

ALIGN_BYTES = 128


@dataclass(frozen=True)
class FullViews:
    # n token rows (int64); S sequences: rows int64, the rest int32; W pages a row
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    head_rows: torch.Tensor  # (S,) int64: each sequence's last token row (padding: row 0)
    logit_rows: torch.Tensor  # (S,) int64: each sequence's row in the logits (arange)
    cu_seqlens_q: torch.Tensor  # (S + 1,)
    prefix_lens: torch.Tensor
    page_table: torch.Tensor  # (S, W)


class FullBuffers:
    """Fixed-address batch, last-row logits and summary that every bucket's full graph shares."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, page_size: int,
                 vocab: int, device: torch.device | str):
        assert max_tokens > 0 and max_seqs > 0 and max_pages > 0 and page_size > 0
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        self.page_size = page_size
        self.words = torch.zeros(self.packing(max_tokens).words, dtype=torch.int64,
                                 device=device)
        self.logits = torch.zeros(max_seqs, vocab, dtype=torch.float32, device=device)
        self.summary = torch.zeros(max_seqs, summary_width(vocab), dtype=torch.float64,
                                   device=device)
        pinned = self.words.is_cuda
        self._stage = torch.empty(self.words.shape, dtype=torch.int64, pin_memory=pinned)
        self._staged = torch.cuda.Event() if pinned else None
        self._np64 = self._stage.numpy()
        self._arange = np.arange(max(max_pages * page_size, max_seqs), dtype=np.int64)
        self._views: dict[int, FullViews] = {}
        self._stage_views: dict[tuple[int, int], tuple] = {}

    def packing(self, n: int) -> Packing:
        s = self.max_seqs
        return Packing.of((n, n, n, s, s), (s + 1, s, s * self.max_pages), ALIGN_BYTES)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.logits, self.summary))

    def fits(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> bool:
        """Whether a batch padded to n tokens fits (not prompt-logprob chunks: last rows only)."""
        return (0 < len(chunks) <= self.max_seqs and n <= self.max_tokens
                and max(len(c.pages) for c in chunks) <= self.max_pages
                and not any(c.all_logits for c in chunks))

    def _parts(self, n: int, b: int, words) -> tuple:
        *parts, table = self.packing(n).cut(words)
        return (*parts, table[:b * self.max_pages].reshape(b, self.max_pages))

    def views(self, n: int) -> FullViews:
        if n not in self._views:
            self._views[n] = FullViews(*self._parts(n, self.max_seqs, self.words))
        return self._views[n]

    def stage(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> None:
        """Fill the pinned staging buffer and queue its copy on the current stream."""
        b, ps = len(chunks), self.page_size
        key = (n, b)
        if key not in self._stage_views:
            self._stage_views[key] = self._slice_stage(n, b)
        ids, pos, slots, head, rows, cu, prefix, table, dst, src = self._stage_views[key]
        if self._staged is not None:
            self._staged.synchronize()  # the previous batch's copy has left the buffer
        table[:] = 0
        t = 0
        for i, ch in enumerate(chunks):
            q, p = ch.num_tokens, ch.prefix_len
            assert pages_for(p + q, ps) <= len(ch.pages), (
                f"positions up to {p + q} need {pages_for(p + q, ps)} pages, "
                f"sequence owns {len(ch.pages)}")
            at = self._arange[p:p + q]
            row = table[i]
            row[:len(ch.pages)] = ch.pages
            ids[t:t + q] = ch.ids
            pos[t:t + q] = at
            slots[t:t + q] = row[at // ps].astype(np.int64) * ps + at % ps
            cu[i + 1], prefix[i], head[i] = t + q, p, t + q - 1
            t += q
        ids[t:], pos[t:], slots[t:], head[b:] = 0, 0, DUMMY_SLOT, 0
        cu[0], cu[b + 1:], prefix[b:] = 0, t, 0
        rows[:] = self._arange[:rows.size]
        # NOTE: non_blocking from pinned memory is a true async copy (on the current stream)
        dst.copy_(src, non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def _slice_stage(self, n: int, b: int) -> tuple:
        k = self.packing(n).words_to(2, b * self.max_pages)
        return (*self._parts(n, b, self._np64), self.words[:k], self._stage[:k])

    def batch(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache, n: int,
              summary: HostCopy | None = None) -> PrefillBatch:
        """NOTE: meta.cu_seqlens_q has max_seqs + 1 entries; meta.q_lens only the live ones."""
        assert kv.page_size == self.page_size, f"page size {kv.page_size} != {self.page_size}"
        v, b = self.views(n), len(chunks)
        meta = ForwardMeta(
            cu_seqlens_q=v.cu_seqlens_q, prefix_lens=v.prefix_lens, page_table=v.page_table,
            slot_mapping=v.slot_mapping, logits_indices=v.head_rows[:b],
            q_lens=tuple(ch.num_tokens for ch in chunks),
            prefix_lens_host=tuple(ch.prefix_len for ch in chunks), kv=kv)
        return PrefillBatch(v.input_ids, v.positions, meta,
                            tuple((i, i + 1) for i in range(b)), v.logit_rows[:b], summary)

    def load(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache, n: int
             ) -> PrefillBatch:
        assert self.fits(chunks, n), "batch does not fit the full graphs' buffers"
        self.stage(chunks, n)
        if self.words.is_cuda:
            torch.cuda.current_stream(self.words.device).synchronize()
        return self.batch(chunks, kv, n)

    def fetch_summary(self, b: int) -> HostCopy:
        return HostCopy(self.summary[:b])


def capture_chunks(n: int, max_positions: int, page_size: int) -> list[SeqChunk]:
    """n tokens in sequences within the RoPE table, every KV row on the dummy page."""
    longest = min(n, max_positions)
    lengths = [longest] * (n // longest) + ([n % longest] if n % longest else [])
    return [SeqChunk((1,) * q, 0, (0,) * -(-q // page_size)) for q in lengths]

