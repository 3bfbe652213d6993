"""The fixed-address buffers a full CUDA graph reads and writes.

A full graph replays the whole forward with one launch, attention included, so its attention
reads fixed buffers instead of the live batch's tensors: up to `max_seqs` sequences
(cu_seqlens_q padded with the token count: the unused sequences are empty and their programs exit
at once), page tables `max_pages` wide, and the KV pool through `KVAddresses` (its per-layer
addresses as device data, so the pool is still allocated after capture). It ends with the LM head
on each sequence's last row and the first token's reductions, whose summary is all the host
copies back.

A forward's host work before the launch is `stage`: the batch is written sequence by sequence into
one pinned buffer and crosses in ONE copy (service.engine.packing, one layout per bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.batch import PrefillBatch, SeqChunk
from service.engine.packing import Packing
from service.engine.pages import DUMMY_SLOT, pages_for
from service.engine.sampling import summary_width
from service.model.meta import ForwardMeta, KVCache

ALIGN = 128  # bytes: every segment of the staged batch starts on a 128-byte boundary


@dataclass(frozen=True)
class FullViews:
    """The fixed tensors one bucket's full graph reads."""

    input_ids: torch.Tensor  # (n,) int64
    positions: torch.Tensor  # (n,) int64
    slot_mapping: torch.Tensor  # (n,) int64
    head_rows: torch.Tensor  # (S,) int64: each sequence's last token row (padding: row 0)
    logit_rows: torch.Tensor  # (S,) int64: each sequence's row in the logits (arange)
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32
    prefix_lens: torch.Tensor  # (S,) int32
    page_table: torch.Tensor  # (S, W) int32


class FullBuffers:
    """Fixed-address inputs and outputs of the full graphs (all buckets share them): the batch,
    and the last rows' fp32 logits and their `summarize` reductions, up to max_seqs rows."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, page_size: int,
                 vocab: int, device: torch.device | str):
        assert max_tokens > 0 and max_seqs > 0 and max_pages > 0 and page_size > 0
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        self.page_size = page_size
        # The batch as int64 words (`packing`), sized for the largest bucket
        self.words = torch.zeros(self.packing(max_tokens).words, dtype=torch.int64,
                                 device=device)
        self.logits = torch.zeros(max_seqs, vocab, dtype=torch.float32, device=device)
        self.summary = torch.zeros(max_seqs, summary_width(vocab), dtype=torch.float64,
                                   device=device)
        # Host side, pinned and allocated once: the staging of the batch copy and the summary's
        # way back, which `_fetched` marks as arrived
        pinned = self.words.is_cuda
        self._stage = torch.empty(self.words.shape, dtype=torch.int64, pin_memory=pinned)
        self._summary_host = torch.empty(self.summary.shape, dtype=torch.float64,
                                         pin_memory=pinned)
        self._fetched = torch.cuda.Event() if pinned else None
        self._np64 = self._stage.numpy()
        self._arange = np.arange(max(max_pages * page_size, max_seqs), dtype=np.int64)
        self._views: dict[int, FullViews] = {}
        self._stage_views: dict[tuple[int, int], tuple] = {}

    def packing(self, n: int) -> Packing:
        """Bucket n's layout: int64 ids, positions, slots (n each), head rows and logit rows
        (S each); int32 cu_seqlens_q (S + 1), prefix lengths (S), page table (S * W)."""
        s = self.max_seqs
        return Packing.of((n, n, n, s, s), (s + 1, s, s * self.max_pages), ALIGN)

    @property
    def nbytes(self) -> int:
        """Device bytes."""
        return sum(t.numel() * t.element_size() for t in (self.words, self.logits, self.summary))

    def fits(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> bool:
        """Whether a batch padded to n tokens can replay a full graph (prompt-logprob chunks,
        which need every row's logits, cannot: the graph's LM head takes last rows only)."""
        return (0 < len(chunks) <= self.max_seqs and n <= self.max_tokens
                and max(len(c.pages) for c in chunks) <= self.max_pages
                and not any(c.all_logits for c in chunks))

    def _parts(self, n: int, b: int, words) -> tuple:
        """Bucket n's segments (FullViews' order; page table rows for b sequences) as views of
        `words`: the device buffer and its staging share the layout."""
        *parts, table = self.packing(n).cut(words)
        return (*parts, table[:b * self.max_pages].reshape(b, self.max_pages))

    def views(self, n: int) -> FullViews:
        if n not in self._views:
            self._views[n] = FullViews(*self._parts(n, self.max_seqs, self.words))
        return self._views[n]

    def stage(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> None:
        """Write a batch (padded to the bucket's n tokens; the caller checked `fits`) into the
        buffers: the host work a full graph waits for, nothing more. NOTE: the previous
        stage's copy must have left the staging buffer (a forward waits for its summary, which
        the GPU copies after the batch; `load` waits for its own copy).

        Filled sequence by sequence straight into the staging arrays: at most max_seqs of them,
        where this beats `host_batch`'s vectorized flattening."""
        b, ps = len(chunks), self.page_size
        key = (n, b)
        if key not in self._stage_views:  # the slices of one (bucket, sequences) layout, once
            self._stage_views[key] = self._slice_stage(n, b)
        ids, pos, slots, head, rows, cu, prefix, table, dst, src = self._stage_views[key]
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
            ids[t:t + q] = ch.id_array()
            pos[t:t + q] = at
            slots[t:t + q] = row[at // ps].astype(np.int64) * ps + at % ps
            cu[i + 1], prefix[i], head[i] = t + q, p, t + q - 1
            t += q
        ids[t:], pos[t:], slots[t:], head[b:] = 0, 0, DUMMY_SLOT, 0
        cu[0], cu[b + 1:], prefix[b:] = 0, t, 0
        rows[:] = self._arange[:rows.size]  # each sequence's row in the logits
        # NOTE: non_blocking from pinned memory is a true async copy (on the current stream)
        dst.copy_(src, non_blocking=True)

    def _slice_stage(self, n: int, b: int) -> tuple:
        """Staging views of bucket n's layout for b sequences, and the copy's two ends."""
        k = self.packing(n).words_to(2, b * self.max_pages)  # through b rows of the table
        return (*self._parts(n, b, self._np64), self.words[:k], self._stage[:k])

    def batch(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache, n: int,
              summary: torch.Tensor | None = None) -> PrefillBatch:
        """The staged batch as a PrefillBatch of views of the buffers (and `summary`). NOTE: its
        meta.cu_seqlens_q has max_seqs + 1 entries (the unused sequences empty), while
        meta.q_lens lists the live ones."""
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
        """`stage` (waiting for its copy: capture and benchmarks), then `batch`."""
        assert self.fits(chunks, n), "batch does not fit the full graphs' buffers"
        self.stage(chunks, n)
        if self.words.is_cuda:
            torch.cuda.current_stream(self.words.device).synchronize()
        return self.batch(chunks, kv, n)

    def fetch_summary(self, b: int) -> torch.Tensor:
        """Queue the copy of the first b summary rows to the host (after the graph); returns
        the host tensor that `fetched_summary` fills (a copy of its own: the next forward
        reuses the pinned buffer)."""
        self._summary_host[:b].copy_(self.summary[:b], non_blocking=True)
        if self._fetched is not None:
            self._fetched.record()
        return torch.empty(self._summary_host[:b].shape, dtype=torch.float64)

    def fetched_summary(self, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (from `fetch_summary`) once the rows have arrived."""
        if self._fetched is not None:
            self._fetched.synchronize()
        return out.copy_(self._summary_host[:out.shape[0]])


def capture_chunks(n: int, max_positions: int, page_size: int) -> list[SeqChunk]:
    """n tokens in sequences no longer than the RoPE table, every KV row on the dummy page
    (a capture's scratch pool holds only that page)."""
    longest = min(n, max_positions)
    lengths = [longest] * (n // longest) + ([n % longest] if n % longest else [])
    return [SeqChunk((1,) * q, 0, (0,) * -(-q // page_size)) for q in lengths]

