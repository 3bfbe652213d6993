"""Breakable CUDA graphs: each bucket's dense steps replayed, attention run eagerly between."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from service.engine.batch import BatchStaging, PrefillBatch, build_batch
from service.engine.runners import (
    Chunks,
    gc_paused,
    on_stream,
    picked_rows,
    with_hidden,
    with_pooled,
)
from service.engine.runners.buckets import Buckets
from service.engine.runners.buffers import StaticBuffers
from service.engine.runners.full_buffers import capture_chunks
from service.engine.runners.graph import SegmentBackend
from service.model.attention import BreakPlan
from service.model.decoder import Activations, DecoderModel
from service.model.meta import KVCache


class BreakableRunner:
    name = "breakable"
    MAX_PLANS = 64  # attention launches kept for reuse; past this the cache starts over

    def __init__(self, model: DecoderModel, buckets: Buckets, backend: SegmentBackend,
                 stream: torch.cuda.Stream | None = None, staging: BatchStaging | None = None):
        self.model, self.cfg, self.buckets, self.backend = model, model.cfg, buckets, backend
        self.stream, self.staging = stream, staging
        self.device, self.dtype = model.device, model.dtype
        self.bufs: StaticBuffers | None = None
        self._plans: dict[tuple, tuple] = {}

    def allocate(self) -> StaticBuffers:
        return StaticBuffers.allocate(self.cfg, self.buckets.largest, self.dtype, self.device,
                                      self.model.mlp_width, scratch=self.model.scheme.scratch)

    @torch.inference_mode()
    def capture(self, kv: KVCache, on_bucket: Callable[[int, int], None] | None = None) -> None:
        """Capture every bucket, largest first, writing KV to scratch pool `kv`'s dummy page."""
        if not len(self.buckets):
            return
        with on_stream(self.stream), gc_paused():
            if self.bufs is None:
                self._plans.clear()
                self.bufs = self.allocate()
            for k, n in enumerate(self.buckets.capture_order()):
                self._capture_bucket(n, kv)
                if on_bucket is not None:
                    on_bucket(k, n)

    def capture_batch(self, n: int, kv: KVCache) -> PrefillBatch:
        return build_batch(capture_chunks(n, self.model.max_positions, kv.page_size), kv,
                           self.device)

    def _capture_bucket(self, n: int, kv: KVCache) -> None:
        v = self.bufs.views(n)
        batch = self.capture_batch(n, kv)
        v.input_ids.copy_(batch.input_ids)
        v.positions.copy_(batch.positions)
        keep = self.capture_inputs(n, v)
        self.backend.capture(n, functools.partial(self.model.run, v), self._plan(batch, v),
                             keep=keep)

    def capture_inputs(self, n: int, v: Activations) -> object:
        """Capture-only tensors bucket n's graphs record, kept alive with them."""
        return None

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(k for k in self.backend.keys if isinstance(k, int)))

    @property
    def static_bytes(self) -> int:
        return self.bufs.nbytes if self.bufs is not None else 0

    def can_run(self, chunks: Chunks, tokens: int) -> bool:
        return (self.buckets.use_graph(tokens)
                and self.backend.has(self.buckets.pad_to_bucket(tokens)))

    @torch.inference_mode()
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]:
        """NOTE: the logits are allocated on the runner's stream (see EagerRunner.run)."""
        tokens = sum(c.num_tokens for c in chunks)
        with on_stream(self.stream):
            batch = build_batch(chunks, kv, self.device, staging=self.staging,
                                pad_to=self.buckets.pad_to_bucket(tokens))
            picked = picked_rows(self.model, batch, chunks)
            logits = self.forward(batch, picked)
            return logits, self.with_outputs(batch, picked, chunks), "graph"

    def forward(self, batch: PrefillBatch, picked: torch.Tensor | None = None) -> torch.Tensor:
        n = batch.padded_tokens
        v = self.bufs.views(n)
        v.input_ids.copy_(batch.input_ids)
        v.positions.copy_(batch.positions)
        self.backend.replay(n, self._attend(batch, v))
        return self.model.logits(v.hidden, batch.meta, picked)

    def with_outputs(self, batch: PrefillBatch, picked: torch.Tensor | None, chunks: Chunks
                     ) -> PrefillBatch:
        """After `forward`: the head's kept rows and the pooled rows, read from the buffers."""
        hidden = self.bufs.views(batch.padded_tokens).hidden
        return with_pooled(with_hidden(batch, picked), hidden, chunks)

    def _attend(self, batch: PrefillBatch, v: Activations) -> Callable[[int], None]:
        """NOTE: bound at the first layer, so the GPU starts the first dense step meanwhile."""
        plan: list[BreakPlan] = []

        def attend(layer: int) -> None:
            if not plan:
                plan.append(self._plan(batch, v))
            plan[0](layer)
        return attend

    def _plan(self, batch: PrefillBatch, v: Activations) -> BreakPlan:
        """The batch's attention for every layer, reused for later batches of the same layout."""
        t, meta, attn = batch.num_tokens, batch.meta, self.model.attn
        if batch.layout is None:
            return attn.plan(v.qkv[:t], meta, v.attn[:t])
        key = (batch.layout, v.input_ids.shape[0], t, meta.max_q_len, meta.max_prefix_len,
               attn.hopper, id(attn), id(meta.kv))
        hit = self._plans.get(key)
        # NOTE: the entry holds `attn` and the pool, so neither id is reused while cached
        if hit is not None and hit[0] is attn and hit[1] is meta.kv:
            return hit[2]
        plan = attn.plan(v.qkv[:t], meta, v.attn[:t])
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[key] = (attn, meta.kv, plan)
        return plan

    def close(self) -> None:
        self._plans.clear()
        self.bufs = None
