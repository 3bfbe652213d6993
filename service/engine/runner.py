"""The prefill runner: pick a bucket, replay the breakable graph (or run eagerly), LM head.

A graph forward copies ids/positions into the static buffers, sets the live-batch handle that
the breaks read, and replays segment, break, segment, ...; the LM head then runs eagerly on the
last-token rows (their count varies). Segment 0 = embedding + pre(layer 0); segment i = post(layer
i-1) + pre(layer i); the last = post(last layer) + final norm. Each break is ONE KV-store launch
and ONE attention launch on the live, unpadded rows, with metadata built once per batch.
Padding rows are never attended to, never stored (the break sees live rows only) and never read
by the LM head.

Small batches (a bucket up to CUDA_GRAPH_FULL_MAX_TOKENS, at most CUDA_GRAPH_FULL_MAX_SEQS
prompts, no prompt logprobs) replay a full graph instead: the same steps with attention, the
LM head and the first-token reductions captured too, reading fixed-shape buffers
(service.engine.full_graph).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from service.engine.batch import BatchStaging, PrefillBatch, SeqChunk, build_batch
from service.engine.buckets import Buckets
from service.engine.buffers import BucketViews, StaticBuffers
from service.engine.dp import DPCaptureInputs, DPGroup, DPTokens, mlp_width, shard_mlp
from service.engine.full_graph import FullBuffers, capture_chunks
from service.engine.graph import SegmentBackend, _Direct
from service.engine.sampling import summarize
from service.model.attention import BreakPlan
from service.model.llama import LlamaModel
from service.model.meta import KVAddresses, KVCache
from service.model.stacked import IndexedLayer, stack_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FullGraphSpec:
    """Which buckets get a full graph and the fixed shapes its attention reads."""

    max_tokens: int  # buckets up to this many tokens (0: no full graphs)
    max_seqs: int = 8  # sequences per batch
    max_pages: int = 2048  # pages per sequence (the longest context / page size)
    # The BLAS library PyTorch's GEMMs use while the full graphs are captured (on CUDA): its
    # kernels are what they replay. cuBLASLt skips the split-K + reduce pair that cuBLAS picks
    # for the Llama shapes' down projection at 128 rows (H200, one 128-token prompt: 135 -> 119
    # kernels and graph GPU time 1.26 -> 1.18 ms on Llama-3.2-1B, 263 -> 231 kernels on
    # Llama-3.1-8B). It costs Qwen2.5-0.5B's o projection ~1 us per layer at 1,024 rows (~2 %
    # of that graph), and SmolLM2's kernels are the same either way.
    blas: str = "cublaslt"


@contextmanager
def blas_library(name: str, device: torch.device) -> Iterator[None]:
    """PyTorch's preferred BLAS library set to `name` inside (CUDA only; restored after)."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage once, then keep Python's GC from running during capture.

    NOTE: a collection in the middle of a capture can destroy unrelated CUDA graphs or events
    (cyclic garbage from an earlier runner), whose teardown is illegal while a stream is being
    captured: the capture is invalidated and surfaces as CUBLAS_STATUS_EXECUTION_FAILED. Seen on
    the H200 in a process that had leaked a runner; SGLang and vLLM pause the GC for the same
    reason.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class PrefillRunner:
    """Graph-or-eager forwards of one model. `backend` None: always eager (CPU, graphs off).

    `dp`: run as one rank of a data-parallel group (the model's MLPs get sharded). The non-DP
    path (dp None) carries no DP work at all. `retain_capture_batch` (benchmarks only) keeps
    every capture batch alive, as upstream did before its retention gate.

    `shared_max_tokens`: buckets of at most this many tokens capture ONE middle segment graph
    that every layer replays, its weights picked by a device-side layer counter
    (service.model.stacked; the model's layer weights get stacked when the runner is built,
    so eager forwards read the same storage). A separate one-kernel counter bump ends that
    segment (one more node per layer; it could ride on the segment's last kernel). Each graph
    holds ~130 KB of driver memory, so this turns buckets x (L + 1) graphs into buckets x 3 for
    those buckets. 0: off. Not with data parallelism (its MLPs are sharded per rank).

    `full`: buckets of at most `full.max_tokens` tokens also capture a full graph (attention
    inside: service.engine.full_graph) that batches of at most `full.max_seqs` sequences replay
    with one launch. Not with data parallelism.

    `fold_norms`: fold the layers' norm weights into their projections (LlamaModel.fold_norms,
    in place, eager forwards too). Ignored with data parallelism and for fp16 models.

    `staging`: batches cross to the device through reused buffers (BatchStaging), and the
    breakable path reuses its attention launch per batch shape; default: on CUDA only.
    """

    def __init__(self, model: LlamaModel, buckets: Buckets, backend: SegmentBackend | None,
                 dp: DPGroup | None = None, stream: torch.cuda.Stream | None = None,
                 retain_capture_batch: bool = False, shared_max_tokens: int = 0,
                 full: FullGraphSpec | None = None, fold_norms: bool = False,
                 staging: bool | None = None):
        self.model, self.cfg = model, model.cfg
        w = next(model.parameters())
        self.device, self.dtype = w.device, w.dtype
        if fold_norms and dp is None and self.dtype != torch.float16:
            model.fold_norms()  # two norm kernels fewer per layer (service.model.llama)
        self.buckets = buckets if backend is not None else Buckets(())
        self.backend = backend
        self.dp = dp
        if dp is not None:
            shard_mlp(model, dp)
        self.stream = stream
        self.retain_capture_batch = retain_capture_batch
        self.shared_max_tokens = shared_max_tokens if dp is None else 0
        self._shared: tuple[IndexedLayer, IndexedLayer] | None = None
        self._layer = torch.zeros(1, dtype=torch.int32, device=self.device)  # the counter
        if self.shared_max_tokens > 0 and backend is not None and len(model.layers) > 1:
            # NOTE: here, not at capture: it moves every layer weight once (freeing the old
            # storage), which must not count as capture memory
            stack_layers(model)
        self.bufs: StaticBuffers | None = None
        self._live: BreakPlan | None = None  # the handle the breaks read at replay
        self.forward_counts = {"graph": 0, "eager": 0}
        self.full = full if dp is None and full is not None and full.max_tokens > 0 else None
        self.full_bufs: FullBuffers | None = None
        self.kv_addrs: KVAddresses | None = None
        self.full_forwards = 0  # graph forwards that replayed a full graph
        # CUDA batches cross through reused buffers, so equal shapes land at equal addresses and
        # a breakable forward's attention launch, bound once per shape, is reused (`_plan`)
        if staging is None:
            staging = self.device.type == "cuda"
        self.staging = BatchStaging(self.device) if staging else None
        self._plans: dict[tuple, tuple] = {}

    # -- selection --------------------------------------------------------------------------------
    def can_use_graph(self, batch: PrefillBatch | int) -> bool:
        n = batch if isinstance(batch, int) else batch.num_tokens
        return self.buckets.use_graph(n) and self.backend.has(self.buckets.pad_to_bucket(n))

    def pad_to_bucket(self, n: int) -> int | None:
        return self.buckets.pad_to_bucket(n)

    def can_use_full(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], n: int) -> bool:
        """A full graph serves this batch of n live tokens (with no other DP rank)."""
        if self.full_bufs is None or not self.buckets.use_graph(n):
            return False
        bucket = self.buckets.pad_to_bucket(n)
        return self.backend.has(("full", bucket)) and self.full_bufs.fits(chunks, bucket)

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run on the runner's stream (warm-up, capture, replay and eager all share it: one
        cuBLAS workspace), ordered after the caller's stream's earlier work (weights, KV pool)
        and before its later work. Forward/capture entry points other than `prefill`,
        `forward_full` (the caller's stream) and `capture` expect to be called inside this."""
        if self.stream is None or torch.cuda.current_stream(self.device) == self.stream:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)

    # -- forward ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache
                ) -> tuple[torch.Tensor, PrefillBatch, str]:
        """Logits (rows, vocab) fp32 on the model's device, the batch, and "graph" | "eager".

        The logits stay on the device: callers reduce them there (service.engine.sampling) and
        copy only the results. NOTE: a breakable or eager forward allocates them on the runner's
        stream; callers may read them on their own stream because the next `prefill` waits for
        that stream before it can reuse their memory. A full graph runs on the caller's stream
        itself (`forward_full`). Data-parallel: every rank must call this in lockstep (an empty
        `chunks` is fine).
        """
        t = sum(c.num_tokens for c in chunks)
        counts = self.dp.all_gather_counts(t) if self.dp is not None else None
        n = max(counts) if counts is not None else t
        if self.can_use_full(chunks, n):
            # NOTE: on the caller's stream: one graph launch needs no stream switch (the
            # switch's two event waits cost the H200's host ~10-20 us before the launch);
            # on_stream's waits order it with the breakable forwards either side
            logits, batch = self.forward_full(chunks, kv, self.buckets.pad_to_bucket(n))
            self.forward_counts["graph"] += 1
            self.full_forwards += 1
            return logits, batch, "graph"
        graph = self.can_use_graph(n)
        with self.on_stream():
            batch = build_batch(chunks, kv, self.device,
                                pad_to=self.buckets.pad_to_bucket(n) if graph else n,
                                staging=self.staging)
            if n == 0:
                logits = torch.empty(0, self.cfg.vocab_size, device=self.device)
            elif graph:
                logits = self.forward_graph(batch, counts)
            else:
                logits = self.forward_eager(batch, counts)
        mode = "graph" if graph else "eager"
        self.forward_counts[mode] += 1
        return logits, batch, mode

    @torch.inference_mode()
    def forward_eager(self, batch: PrefillBatch, counts: list[int] | None = None) -> torch.Tensor:
        dp = None
        if self.dp is not None:
            rows = batch.padded_tokens
            if counts is None:  # a lone caller (tests, world size 1): this rank's rows only
                assert self.dp.world == 1, "DP ranks must pass every rank's token counts"
                counts = [batch.num_tokens]
            dp = DPTokens(self.dp, rows, DPCaptureInputs.new(counts, rows, self.device))
        return self.model(batch.input_ids, batch.positions, batch.meta, dp=dp)

    @torch.inference_mode()
    def forward_graph(self, batch: PrefillBatch, counts: list[int] | None = None,
                      replay: bool = True) -> torch.Tensor:
        """Through the static buffers: graph replay, or (replay=False) the same steps eagerly."""
        n = batch.padded_tokens
        assert self.bufs is not None and self.backend.has(n), f"no graph for {n} tokens"
        v = self.bufs.views(n)
        v.input_ids.copy_(batch.input_ids)
        v.positions.copy_(batch.positions)
        if self.dp is not None:
            self._dp_inputs(n).fill(counts if counts is not None else [batch.num_tokens], n)
        # NOTE: the break is prepared at the first break, not here: the GPU starts on the first
        # dense segment (embedding, norm, QKV, RoPE) while the host binds the attention launch.
        plan: list[BreakPlan | None] = []

        def live(layer: int) -> None:
            if not plan:
                plan.append(self._plan(batch, v))
            if plan[0] is not None:
                plan[0](layer)

        self._live = live
        try:
            if replay:
                self.backend.replay(n)
            else:
                self._run_once(v, self._static_dp_tokens(v))(_Direct())
        finally:
            self._live = None
        return self.model.logits(v.hidden, batch.meta)

    def forward_full(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], kv: KVCache, n: int
                     ) -> tuple[torch.Tensor, PrefillBatch]:
        """Stage the batch into the full graphs' buffers and replay bucket n's full graph: the
        forward with attention, the LM head on each sequence's last row and `summarize`; the
        returned batch's summary is on the host. Only the staging precedes the launch: the
        batch's metadata is built, and the logits copied, while the graph runs."""
        fb, b = self.full_bufs, len(chunks)
        self.kv_addrs.bind(kv)
        fb.stage(chunks, n)
        self.backend.replay(("full", n))
        summary = fb.fetch_summary(b)
        # NOTE: a copy, not a view: the next forward overwrites the graph's buffers
        logits = fb.logits[:b].clone()
        batch = fb.batch(chunks, kv, n, summary)
        fb.fetched_summary(summary)  # the host waits here, for the graph and the copy
        return logits, batch

    # -- capture ----------------------------------------------------------------------------------
    def _run_once(self, v: BucketViews, dp: DPTokens | None, plan: BreakPlan | None = None,
                  head_rows: torch.Tensor | None = None) -> Callable[[object], None]:
        """The forward of one bucket as dense steps and breaks. NOTE: closes over static views
        and DP capture-only tensors only; the breaks read the live batch from `self._live`,
        or with `plan` (a full graph's static break) call it, captured with the rest; then
        with `head_rows` the LM head on those rows and their first-token reductions, into the
        full graphs' output buffers."""
        m, layers = self.model, self.model.layers
        shared = self._shared if v.n <= self.shared_max_tokens and plan is None else None
        counter = self._layer

        def first() -> None:
            if shared is not None:
                counter.zero_()
            m.embed(v.input_ids, out=v.residual)
            if m.fuses_norm(v.n):  # the norm rides on RoPE: QKV reads the residual itself
                layers[0].pre(None, v.residual, v.positions, m.cos_sin, qkv_out=v.qkv)
                return
            layers[0].input_layernorm(v.residual, out=v.hidden)
            layers[0].qkv_rope(v.hidden, v.positions, m.cos_sin, out=v.qkv)

        def segment(i: int) -> Callable[[], None]:
            def run() -> None:
                # h: v.hidden, or None without norm kernels (the residual holds the whole state)
                h, _ = layers[i].post(v.attn, v.residual, h_out=v.hidden, scratch=v.mlp_scratch,
                                      dp=dp)
                if i + 1 < len(layers):
                    layers[i + 1].pre(h, v.residual, v.positions, m.cos_sin, qkv_out=v.qkv)
                else:  # hidden <- norm(hidden + residual), in place (or norm(residual))
                    m.final_norm(h, v.residual, out=v.hidden)
            return run

        def middle() -> None:  # post(c) + pre(c + 1) for the layer c = counter, then c += 1
            h, _ = shared[0].post(v.attn, v.residual, h_out=v.hidden, scratch=v.mlp_scratch)
            shared[1].pre(h, v.residual, v.positions, m.cos_sin, qkv_out=v.qkv)
            counter.add_(1)

        def brk(i: int) -> Callable[[], None]:
            if plan is not None:
                return lambda: plan(i)

            def run() -> None:
                # NOTE: None when no batch is bound; forward_graph's handle itself skips a DP
                # rank with no live rows
                if self._live is not None:
                    self._live(i)
            return run

        def head() -> None:  # the summary kernel also writes the fp32 logits
            out = self.full_bufs
            summarize(m.head_at(v.hidden, head_rows), out=out.summary, logits_out=out.logits)

        def run_once(rec) -> None:
            rec.dense(first)
            for i in range(len(layers)):
                rec.brk(brk(i))
                if shared is not None and i + 1 < len(layers):
                    rec.dense(middle, share="middle")
                else:
                    rec.dense(segment(i))
            if head_rows is not None:
                rec.dense(head)
        return run_once

    MAX_PLANS = 64  # bound attention launches kept for reuse; past this the cache starts over

    def _plan(self, batch: PrefillBatch, v: BucketViews) -> BreakPlan | None:
        """The live batch's break, prepared once for every layer; reused for a later batch that
        was staged at the same layout with the same host-side facts (binding one costs the
        H200's host 0.1-0.3 ms while the GPU has only the first segment to run:
        bench/results/host-split-brk-s11-*)."""
        t, meta, attn = batch.num_tokens, batch.meta, self.model.attn
        if not t:
            return None
        if batch.layout is None:
            return attn.plan(v.qkv[:t], meta, v.attn[:t])
        key = (batch.layout, v.n, t, meta.max_q_len, meta.max_prefix_len, attn.hopper, id(attn),
               id(meta.kv))
        hit = self._plans.get(key)
        # NOTE: the entry holds the backend and the pool it was bound for, so neither id can
        # be reused by another object while it is cached
        if hit is not None and hit[0] is attn and hit[1] is meta.kv:
            return hit[2]
        plan = attn.plan(v.qkv[:t], meta, v.attn[:t])
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[key] = (attn, meta.kv, plan)
        return plan

    def capture_batch(self, n: int, kv: KVCache) -> PrefillBatch:
        """n tokens (sequences no longer than the RoPE table) whose KV all goes to the dummy
        page: the scratch pool needs only that page, and no prefix is read. Tests wrap this
        to watch batch lifetimes."""
        return build_batch(capture_chunks(n, self.model.max_positions, kv.page_size), kv,
                           self.device)

    def _dp_inputs(self, n: int) -> DPCaptureInputs:
        kept = self.backend.retained(n)
        return kept[1] if isinstance(kept, tuple) else kept

    def _static_dp_tokens(self, v: BucketViews) -> DPTokens | None:
        if self.dp is None:
            return None
        return DPTokens(self.dp, v.n, self._dp_inputs(v.n), v.gathered, v.partial)

    @torch.inference_mode()
    def capture(self, scratch_kv: KVCache, on_bucket: Callable[[int, int], None] | None = None
                ) -> None:
        """Allocate the static buffers, then capture every bucket, largest first."""
        if self.backend is None or not len(self.buckets):
            return
        with self.on_stream(), gc_paused():
            if self.shared_max_tokens > 0 and self._shared is None and len(self.model.layers) > 1:
                stack = stack_layers(self.model)  # stacked in __init__: returns that stack
                self._shared = (IndexedLayer(self.model, stack, self._layer, 0),
                                IndexedLayer(self.model, stack, self._layer, 1))
            if self.bufs is None:
                world = self.dp.world if self.dp is not None else 1
                self._plans.clear()  # bound to the old buffers' views, if any
                self.bufs = StaticBuffers.allocate(self.cfg, self.buckets.largest, self.dtype,
                                                   self.device, mlp_width(self.model), world)
            for k, n in enumerate(self.buckets.capture_order()):
                self._capture_bucket(n, scratch_kv)
                if on_bucket is not None:
                    on_bucket(k, n)
            if self.full is not None:
                self._capture_full(scratch_kv)

    def _capture_full(self, kv: KVCache) -> None:
        """One full graph per bucket of at most full.max_tokens (after the breakable ones: it
        allocates nothing, every tensor it touches is a static buffer)."""
        sizes = [n for n in self.buckets.capture_order() if n <= self.full.max_tokens]
        if not sizes or len(self.model.layers) == 0:
            return
        if self.full_bufs is None:
            self.full_bufs = FullBuffers(max(sizes), self.full.max_seqs, self.full.max_pages,
                                         kv.page_size, self.cfg.vocab_size, self.device)
            self.kv_addrs = KVAddresses(len(self.model.layers), self.device)
        self.kv_addrs.bind(kv)
        try:
            with blas_library(self.full.blas, self.device):
                for n in sizes:
                    self._capture_full_bucket(n, kv)
        finally:
            self.kv_addrs.unbind()  # the scratch pool must be freeable before KV sizing

    def _capture_full_bucket(self, n: int, kv: KVCache) -> None:
        fv = self.full_bufs.views(n)
        self.full_bufs.load(capture_chunks(n, self.model.max_positions, kv.page_size), kv, n)
        v = dataclasses.replace(self.bufs.views(n), input_ids=fv.input_ids,
                                positions=fv.positions)
        plan = self.model.attn.plan_static(v.qkv, v.attn, fv.cu_seqlens_q, fv.prefix_lens,
                                           fv.page_table, fv.slot_mapping, self.kv_addrs)
        self.backend.capture_one(("full", n), self._run_once(v, None, plan, fv.head_rows),
                                 whole=True)

    def _capture_bucket(self, n: int, kv: KVCache) -> None:
        v = self.bufs.views(n)
        batch = self.capture_batch(n, kv)
        v.input_ids.copy_(batch.input_ids)
        v.positions.copy_(batch.positions)
        dp = None
        if self.dp is not None:
            counts = [n] * self.dp.world
            dp = DPTokens(self.dp, n, DPCaptureInputs.new(counts, n, self.device), v.gathered,
                          v.partial)
        keep = dp.inputs if dp is not None else None  # the retention gate
        if self.retain_capture_batch:
            keep = (batch, keep)
        self._live = self._plan(batch, v)
        try:
            self.backend.capture_one(n, self._run_once(v, dp), capture_inputs=keep)
        finally:
            self._live = None
        del batch, keep, dp

    @torch.inference_mode()
    def measure_eager_peak(self, n: int, scratch_kv: KVCache) -> int:
        """Activation peak (bytes) of one eager forward of n tokens; 0 off CUDA."""
        if n <= 0:
            return 0
        counts = [n] * self.dp.world if self.dp is not None else None
        with self.on_stream():
            batch = self.capture_batch(n, scratch_kv)
            if self.device.type != "cuda":
                self.forward_eager(batch, counts)
                return 0
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.forward_eager(batch, counts)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
        del batch
        torch.cuda.empty_cache()
        return peak

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def retained_input_bytes(self) -> int:
        return self.backend.retained_bytes() if self.backend is not None else 0

    @property
    def static_bytes(self) -> int:
        full = self.full_bufs.nbytes if self.full_bufs is not None else 0
        addrs = self.kv_addrs.table.numel() * 8 if self.kv_addrs is not None else 0
        return (self.bufs.nbytes if self.bufs is not None else 0) + full + addrs

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets with a (breakable) graph."""
        if self.backend is None:
            return ()
        return tuple(sorted(k for k in self.backend.shape_keys if isinstance(k, int)))

    @property
    def full_captured(self) -> tuple[int, ...]:
        """Buckets that also have a full graph."""
        if self.backend is None:
            return ()
        return tuple(sorted(k[1] for k in self.backend.shape_keys if isinstance(k, tuple)))

    def close(self) -> None:
        """Free the graphs, their pool and the static buffers."""
        if self.backend is not None:
            self.backend.close()
        self._plans.clear()
        self.bufs = None
        self.full_bufs = self.kv_addrs = None
