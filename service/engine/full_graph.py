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

`FullBuffers` owns those buffers and loads a batch into them with two host-to-device copies (one
per dtype) from pinned staging buffers: ids, positions, slots, head rows (int64) and cu_seqlens_q,
prefix lengths, page table (int32), at offsets fixed per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.batch import PrefillBatch, SeqChunk, host_batch
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
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32
    prefix_lens: torch.Tensor  # (S,) int32
    page_table: torch.Tensor  # (S, W) int32


class FullBuffers:
    """Fixed-address inputs and outputs of the full graphs (all buckets share them): the batch,
    and the last rows' fp32 logits and their `summarize` reductions, up to max_seqs rows."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, vocab: int,
                 device: torch.device | str):
        assert max_tokens > 0 and max_seqs > 0 and max_pages > 0
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        r, s = _round_up(max_tokens), max_seqs
        # int64: ids | positions | slots at multiples of round_up(n), then the head's token rows
        # (S, padded with row 0), then each sequence's row in the logits (arange)
        self.i64 = torch.zeros(3 * r + 2 * s, dtype=torch.int64, device=device)
        # int32: cu_seqlens_q (S + 1) | prefix lengths (S) | page table (S, W)
        self.i32 = torch.zeros(2 * s + 1 + s * max_pages, dtype=torch.int32, device=device)
        self.logits = torch.zeros(s, vocab, dtype=torch.float32, device=device)
        self.summary = torch.zeros(s, summary_width(vocab), dtype=torch.float64, device=device)
        # Host staging of the two copies, allocated once (a pinned allocation per forward cost
        # ~0.1 ms of host time on the H200's host), guarded by an event: a load waits until the
        # previous load's copies have left the staging buffers (long done by the next forward).
        pinned = self.i64.is_cuda
        self._stage64 = torch.empty(self.i64.shape, dtype=torch.int64, pin_memory=pinned)
        self._stage32 = torch.empty(self.i32.shape, dtype=torch.int32, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None

    @property
    def nbytes(self) -> int:
        """Device bytes."""
        return sum(t.numel() * t.element_size()
                   for t in (self.i64, self.i32, self.logits, self.summary))

    def fits(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> bool:
        """Whether a batch padded to n tokens can replay a full graph (prompt-logprob chunks,
        which need every row's logits, cannot: the graph's LM head takes last rows only)."""
        return (0 < len(chunks) <= self.max_seqs and n <= self.max_tokens
                and max(len(c.pages) for c in chunks) <= self.max_pages
                and not any(c.all_logits for c in chunks))

    def views(self, n: int) -> FullViews:
        r, s = _round_up(n), self.max_seqs
        return FullViews(
            input_ids=self.i64[:n], positions=self.i64[r:r + n],
            slot_mapping=self.i64[2 * r:2 * r + n], head_rows=self.i64[3 * r:3 * r + s],
            cu_seqlens_q=self.i32[:s + 1], prefix_lens=self.i32[s + 1:2 * s + 1],
            page_table=self.i32[2 * s + 1:].view(s, self.max_pages))

    def load(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache, n: int
             ) -> PrefillBatch:
        """Write a batch (padded to the bucket's n tokens) into the buffers; the returned batch's
        tensors are views of them. NOTE: its meta.cu_seqlens_q has max_seqs + 1 entries (the
        unused sequences empty), while meta.q_lens lists the live ones."""
        assert self.fits(chunks, n), "batch does not fit the full graphs' buffers"
        h = host_batch(chunks, kv.page_size, pad_to=n)
        r, s, w = _round_up(n), self.max_seqs, self.max_pages
        b, t = len(chunks), int(h.cu[-1])

        if self._copied is not None:
            self._copied.synchronize()
        i64 = self._stage64[:3 * r + 2 * s]
        a = i64.numpy()
        a[:n], a[r:r + n], a[2 * r:2 * r + n] = h.ids, h.positions, h.slots
        a[3 * r:3 * r + b], a[3 * r + b:3 * r + s] = h.logits_idx, 0  # one row per sequence
        a[3 * r + s:] = np.arange(s)
        i32 = self._stage32[:2 * s + 1 + b * w]
        c = i32.numpy()
        c[:b + 1], c[b + 1:s + 1] = h.cu, t
        c[s + 1:s + 1 + b], c[s + 1 + b:2 * s + 1] = h.prefix, 0
        table = c[2 * s + 1:].reshape(b, w)
        table[:] = 0
        table[:, :h.table.shape[1]] = h.table
        # NOTE: non_blocking from pinned memory is a true async copy (on the current stream)
        self.i64[:i64.numel()].copy_(i64, non_blocking=True)
        self.i32[:i32.numel()].copy_(i32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

        v = self.views(n)
        meta = ForwardMeta(
            cu_seqlens_q=v.cu_seqlens_q, prefix_lens=v.prefix_lens, page_table=v.page_table,
            slot_mapping=v.slot_mapping, logits_indices=v.head_rows[:b],
            q_lens=h.q_lens, prefix_lens_host=h.prefix_lens, kv=kv)
        return PrefillBatch(v.input_ids, v.positions, meta, h.logits_rows,
                            self.i64[3 * r + s:3 * r + s + b])


def capture_chunks(n: int, max_positions: int, page_size: int) -> list[SeqChunk]:
    """n tokens in sequences no longer than the RoPE table, every KV row on the dummy page
    (a capture's scratch pool holds only that page)."""
    longest = min(n, max_positions)
    lengths = [longest] * (n // longest) + ([n % longest] if n % longest else [])
    return [SeqChunk((1,) * q, 0, (0,) * -(-q // page_size)) for q in lengths]

