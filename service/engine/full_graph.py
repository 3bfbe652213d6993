"""Full CUDA graphs for small buckets: the whole forward, attention included, in one graph.

A breakable forward of a small batch is bound by host launches, not by the GPU: every layer's
break costs the host a KV-store/attention launch and the next segment's replay, ~25 us per layer
on the H200's host, against ~30 us of GPU work per layer for SmolLM2-135M at 128 tokens. A full
graph replays the whole forward (embedding to final norm) with one launch.

Its attention cannot depend on the live batch's shape, so it reads fixed buffers instead:
  - up to `max_seqs` sequences: cu_seqlens_q is padded with the token count, so the unused
    sequences are empty and their programs exit at once (the grid is bucket q-blocks x max_seqs);
  - page tables `max_pages` wide (the longest context the engine accepts);
  - the KV pool through `KVAddresses` (its per-layer addresses as device data), so the pool is
    still allocated after capture, at its final address, and is never baked into a graph.
A batch with more sequences, or a bucket above CUDA_GRAPH_FULL_MAX_TOKENS, replays the
breakable graph of its bucket as before; so does a batch that wants every row's logits (prompt
logprobs).

The graph ends with the LM head on each sequence's last row (max_seqs rows, the unused ones
reading row 0) and the reductions the first token needs (service.engine.sampling.summarize):
after the launch, one device-to-host copy of the live rows' summary is all the host waits for,
instead of ~30 more launches.

`FullBuffers` owns those buffers. A forward's host work before the graph can start is kept to
`stage`: the batch is written sequence by sequence into one pinned staging buffer and crosses
in ONE host-to-device copy (ids, positions, slots, head rows as int64 words, then cu_seqlens_q,
prefix lengths and page table as int32 in the words after them, at offsets fixed per bucket).
The batch's Python-side metadata is built while the graph runs, and the summary comes back
through a pinned buffer and an event, not a pageable copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.batch import PrefillBatch, SeqChunk
from service.engine.pages import DUMMY_SLOT, pages_for
from service.engine.sampling import summary_width
from service.model.meta import ForwardMeta, KVCache

_ALIGN = 16  # elements: every int64 segment starts 128-byte aligned


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


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
        # The batch as int64 words (layout: `_layout`), sized for the largest bucket
        self.words = torch.zeros(self._layout(max_tokens)[-1], dtype=torch.int64, device=device)
        self.logits = torch.zeros(max_seqs, vocab, dtype=torch.float32, device=device)
        self.summary = torch.zeros(max_seqs, summary_width(vocab), dtype=torch.float64,
                                   device=device)
        # Host side, pinned and allocated once: the staging of the batch copy (with the fill in
        # `stage`, a load went from 0.19-0.33 to 0.10-0.16 ms of host time on the H200's host)
        # and the summary's way back, which `_fetched` marks as arrived
        pinned = self.words.is_cuda
        self._stage = torch.empty(self.words.shape, dtype=torch.int64, pin_memory=pinned)
        self._summary_host = torch.empty(self.summary.shape, dtype=torch.float64,
                                         pin_memory=pinned)
        self._fetched = torch.cuda.Event() if pinned else None
        self._np64 = self._stage.numpy()
        self._np32 = self._np64.view(np.int32)
        self._arange = np.arange(max(max_pages * page_size, max_seqs), dtype=np.int64)
        self._views: dict[int, FullViews] = {}
        self._stage_views: dict[tuple[int, int], tuple] = {}

    def _layout(self, n: int) -> tuple[int, int, int]:
        """Bucket n's layout: int64 words [ids | positions | slots] (round_up(n) each), then
        the head's token rows (S, padded with row 0) and each sequence's row in the logits
        (arange S); from word `w32` on, int32 [cu_seqlens_q (S + 1) | prefix lengths (S) |
        page table (S, W)]. Returns (round_up(n), w32, words in all)."""
        r, s = _round_up(n), self.max_seqs
        w32 = _round_up(3 * r + 2 * s)  # 128-byte aligned, as the int64 segments are
        return r, w32, w32 + -(-(2 * s + 1 + s * self.max_pages) // 2)

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

    def _parts(self, n: int, b: int, w64, w32) -> tuple:
        """Bucket n's segments (FullViews' order; page table rows for b sequences) cut from
        one buffer seen as int64 words `w64` and as int32 `w32`: the device buffer and its
        staging share this layout."""
        (r, o, _), s, w = self._layout(n), self.max_seqs, self.max_pages
        c = w32[2 * o:2 * o + 2 * s + 1 + b * w]
        return (w64[:n], w64[r:r + n], w64[2 * r:2 * r + n], w64[3 * r:3 * r + s],
                w64[3 * r + s:3 * r + 2 * s], c[:s + 1], c[s + 1:2 * s + 1],
                c[2 * s + 1:].reshape(b, w))

    def views(self, n: int) -> FullViews:
        if n not in self._views:
            self._views[n] = FullViews(*self._parts(n, self.max_seqs, self.words,
                                                    self.words.view(torch.int32)))
        return self._views[n]

    def stage(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> None:
        """Write a batch (padded to the bucket's n tokens; the caller checked `fits`) into the
        buffers: the host work a full graph waits for, nothing more. NOTE: the previous
        stage's copy must have left the staging buffer (a forward waits for its summary, which
        the GPU copies after the batch; `load` waits for its own copy).

        Filled sequence by sequence straight into the staging arrays (at most max_seqs of them):
        ~4x less host time than flattening through `host_batch` (whose vectorized form pays
        off on batches of many sequences)."""
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
        parts = self._parts(n, b, self._np64, self._np32)
        k = self._layout(n)[1] + -(-(parts[5].size + parts[6].size + parts[7].size) // 2)
        return (*parts, self.words[:k], self._stage[:k])  # k: the words the copy moves

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

