"""Full CUDA graphs for launch-bound small batches: the whole forward in one launch (cuBLASLt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from service.engine.batch import PrefillBatch
from service.engine.runners import Chunks, gc_paused, on_stream, with_hidden, with_pooled
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.full_buffers import FullBuffers, capture_chunks
from service.engine.sampling import summarize
from service.model.decoder import Eager
from service.model.meta import KVAddresses, KVCache

BLAS = "cublaslt"


@contextmanager
def blas_library(name: str, device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class FullGraphRunner:
    """Full graphs of the breakable runner's buckets up to `max_tokens`, in its buffers and pool."""

    name = "full"

    def __init__(self, graphs: BreakableRunner, max_tokens: int, max_seqs: int,
                 max_pages: int):
        self.graphs, self.model, self.backend = graphs, graphs.model, graphs.backend
        self.sizes = tuple(n for n in graphs.buckets if n <= max_tokens)
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.bufs: FullBuffers | None = None
        self.hidden: torch.Tensor | None = None  # (max_seqs, hidden): the head's normed rows
        self.kv_addrs: KVAddresses | None = None

    @torch.inference_mode()
    def capture(self, kv: KVCache) -> None:
        """One full graph per bucket; after the breakable capture (it uses their buffers)."""
        if not self.sizes or not self.model.cfg.num_layers or self.graphs.bufs is None:
            return
        device = self.graphs.device
        if self.bufs is None:
            self.bufs = FullBuffers(max(self.sizes), self.max_seqs, self.max_pages,
                                    kv.page_size, self.model.cfg.vocab_size, device)
            self.kv_addrs = KVAddresses(self.model.cfg.num_layers, device)
            self.hidden = torch.zeros(self.max_seqs, self.model.cfg.hidden_size,
                                      dtype=self.model.dtype, device=device)
        self.kv_addrs.bind(kv)
        try:
            with on_stream(self.graphs.stream), gc_paused(), blas_library(BLAS, device):
                for n in reversed(self.sizes):
                    self._capture_bucket(n, kv)
        finally:
            self.kv_addrs.unbind()  # the scratch pool must be freeable before KV sizing

    def _capture_bucket(self, n: int, kv: KVCache) -> None:
        fv = self.bufs.views(n)
        self.bufs.load(capture_chunks(n, self.model.max_positions, kv.page_size), kv, n)
        acts = dataclasses.replace(self.graphs.bufs.views(n), input_ids=fv.input_ids,
                                   positions=fv.positions)
        attend = self.model.attn.plan_static(acts.qkv, acts.attn, fv.cu_seqlens_q,
                                             fv.prefix_lens, fv.page_table, fv.slot_mapping,
                                             self.kv_addrs)
        out = self.bufs

        def forward() -> None:
            self.model.run(acts, Eager(attend))
            summarize(self.model.head_at(acts.hidden, fv.head_rows, self.hidden), out=out.summary,
                      logits_out=out.logits)

        self.backend.capture_whole(("full", n), forward)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(k[1] for k in self.backend.keys if isinstance(k, tuple)))

    @property
    def static_bytes(self) -> int:
        if self.bufs is None:
            return 0
        return (self.bufs.nbytes + self.kv_addrs.table.numel() * 8
                + self.hidden.numel() * self.hidden.element_size())

    def can_run(self, chunks: Chunks, tokens: int) -> bool:
        if self.bufs is None or not self.graphs.buckets.use_graph(tokens):
            return False
        n = self.graphs.buckets.pad_to_bucket(tokens)
        return self.backend.has(("full", n)) and self.bufs.fits(chunks, n)

    @torch.inference_mode()
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]:
        """Stage and replay on the caller's stream; nothing here waits for the GPU."""
        n = self.graphs.buckets.pad_to_bucket(sum(c.num_tokens for c in chunks))
        fb, b = self.bufs, len(chunks)
        self.kv_addrs.bind(kv)
        fb.stage(chunks, n)
        self.backend.replay(("full", n))
        summary = fb.fetch_summary(b)
        logits = fb.logits[:b].clone()  # NOTE: a copy: the next forward overwrites the buffer
        batch = fb.batch(chunks, kv, n, summary)
        asked = any(c.hidden for c in chunks)  # read at launch, before the next replay
        # pooling reduces the graph's final-norm rows after the replay: no capture memory
        batch = with_pooled(batch, self.graphs.bufs.views(n).hidden, chunks)
        return logits, with_hidden(batch, self.hidden[:b] if asked else None), "graph"

    def close(self) -> None:
        self.bufs = self.kv_addrs = self.hidden = None
