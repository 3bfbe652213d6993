"""EngineCore: load → capture → size the KV pool → warm up → forward batches.

A forward goes to the first runner that accepts it: full graph, breakable graphs, eager."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from kernels.extend_attention_config import prefix_batch_rows
from service.config import EngineConfig
from service.engine.batch import BatchStaging, SeqChunk
from service.engine.buckets import Buckets, resolve_buckets
from service.engine.capture import Graphs, capture_and_size
from service.engine.dp import DPGroup, DPRunner
from service.engine.graph import CudaGraphBackend
from service.engine.host_copy import HostCopy
from service.engine.interface import EngineInfo, MemoryReport
from service.engine.kv_pool import KVPool
from service.engine.memory import (
    InsufficientMemory,
    MemoryReader,
    cuda_free_bytes,
    gib,
)
from service.engine.pages import pages_for
from service.engine.runners import Runner
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.eager import EagerRunner
from service.engine.runners.full import FullGraphRunner
from service.engine.sampling import LastRow, named_rows, summarize, unpack
from service.model.errors import ModelLoadError
from service.model.loader import LoadedModel, load
from service.model.quant import apply as apply_quantization

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

__all__ = ["EngineCore", "ForwardOutput", "InsufficientMemory", "Launched", "MemoryReport"]


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor]  # per chunk: (rows, vocab) fp32 on the model's device
    last: list[LastRow]  # per chunk: its last row's greedy token and top logprobs, on the host
    mode: str  # "graph" | "eager"
    seconds: float  # from launch until its summary reached the host


class Launched:
    """A queued forward; its logits are its own, so the next may launch before its `wait()`."""

    __slots__ = ("logits", "summary", "named", "mode", "t0")

    def __init__(self, logits: list[torch.Tensor], summary: HostCopy | None, mode: str,
                 t0: float, named: tuple[list[int], HostCopy] | None = None):
        self.logits, self.summary, self.mode, self.t0 = logits, summary, mode, t0
        self.named = named  # (chunks that name tokens, their logprobs on the way to the host)

    def ready(self) -> bool:
        return ((self.summary is None or self.summary.ready())
                and (self.named is None or self.named[1].ready()))

    def wait(self) -> ForwardOutput:
        last = unpack(self.summary.get()) if self.summary is not None else []
        if self.named is not None:
            chunks, copy = self.named
            for i, vals in zip(chunks, copy.get().tolist()):
                last[i].named = vals
        return ForwardOutput(self.logits, last, self.mode, time.perf_counter() - self.t0)


def warm_up_batches(full_max_seqs: int, page_size: int, max_tokens: int, max_positions: int
                    ) -> list[list[SeqChunk]]:
    def prompt(n: int) -> SeqChunk:
        return SeqChunk([1] * n, page_size, [0] * pages_for(page_size + n, page_size))

    first, *longer = prefix_batch_rows()
    out = [[prompt(first) for _ in range(full_max_seqs + 1)], *([prompt(n)] for n in longer)]
    return [b for b in out if sum(c.num_tokens for c in b) <= max_tokens
            and page_size + max(c.num_tokens for c in b) <= max_positions]


class EngineCore:
    """With `dp_group`, every rank calls `forward` in lockstep."""

    def __init__(self, cfg: EngineConfig, *, loaded: LoadedModel | None = None,
                 memory_reader: MemoryReader | None = None, dp_group: DPGroup | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = _DTYPES[cfg.dtype]
        cuda = self.device.type == "cuda"
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        reader = memory_reader or (cuda_free_bytes(self.device) if cuda else None)
        free_before = reader() if reader is not None else 0
        loaded = loaded or load(cfg.model_path, cfg.model_preset, self.device, self.dtype)
        self.model, self.tokenizer, self.model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self.model.attn.hopper = cfg.attention_hopper_kernel
        self.model_path = str(loaded.path)
        apply_quantization(self.model, cfg.quantization)  # what it frees joins the KV pool
        self.precision = self.model.scheme.label
        if self.model.quantized and dp_group is not None:
            raise ModelLoadError(f"{self.model_path}: {self.precision} projections are not "
                                 "sharded across data-parallel ranks")
        if cfg.fold_norms and dp_group is None and self.dtype != torch.float16:
            self.model.fold_norms()  # not into projections that cannot take a norm's weight
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # On the CPU a launch runs the whole forward: nothing to overlap with the next one
        self.synchronous = not cuda
        self.graphs, self.runners = self._runners(dp_group)
        self.forward_counts = {"graph": 0, "eager": 0}
        self.runs = {r.name: 0 for r in self.runners}
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        context = min(cfg.max_prompt_tokens, self.model.max_positions)
        if reader is not None:
            report, plan = capture_and_size(
                self.model, self.graphs, self.runners[-1], self.stream, reader, free_before,
                weights, cfg.mem_fraction_static, cfg.page_size, cfg.max_prefill_tokens)
            kv_tokens = plan.tokens
        else:
            report = MemoryReport(
                free_before_bytes=0, weights_bytes=weights, capture_bytes=0,
                retained_input_bytes=0, kv_bytes=0, kv_tokens=0, reserve_bytes=0,
                eager_peak_bytes=0, mem_fraction_static=cfg.mem_fraction_static,
                capture_seconds=0.0, path="cpu")
            if cfg.kv_cache_bytes is None:  # room for two prompts of the longest accepted length
                kv_tokens = 2 * pages_for(context, cfg.page_size) * cfg.page_size
            else:
                bpt = self.model_cfg.kv_bytes_per_token(self.dtype.itemsize)
                kv_tokens = max(cfg.kv_cache_bytes // bpt // cfg.page_size - 1, 2) * cfg.page_size
        self.pool = KVPool(self.model_cfg, kv_tokens, cfg.page_size, self.dtype, self.device)
        if cuda:
            torch.cuda.synchronize(self.device)  # the pool's zero-fill, before the stream uses it
        self.memory = dataclasses.replace(report, kv_bytes=self.pool.nbytes,
                                          kv_tokens=self.pool.capacity_tokens)
        self.warm_up()
        self._log_ready()

    def _runners(self, dp_group: DPGroup | None) -> tuple[Graphs | None, list[Runner]]:
        """The graph runners (None without graphs) and every runner, in the order asked."""
        cfg = self.cfg
        sizes = (resolve_buckets(cfg.cuda_graph_buckets, cfg.cuda_graph_max_tokens,
                                 cfg.max_prefill_tokens) if self.stream is not None else ())
        backend = CudaGraphBackend(self.stream) if sizes else None
        if dp_group is not None:
            dp = DPRunner(self.model, Buckets(sizes), backend, dp_group, self.stream)
            return (Graphs(dp) if sizes else None), [dp]
        staging = BatchStaging(self.device) if self.stream is not None else None
        eager = EagerRunner(self.model, self.stream, staging)
        if not sizes:
            return None, [eager]
        breakable = BreakableRunner(self.model, Buckets(sizes), backend, self.stream, staging)
        full = None
        if cfg.cuda_graph_full_max_tokens > 0:
            context = min(cfg.max_prompt_tokens, self.model.max_positions)
            full = FullGraphRunner(breakable, cfg.cuda_graph_full_max_tokens,
                                   cfg.cuda_graph_full_max_seqs,
                                   pages_for(context, cfg.page_size))
        graphs = Graphs(breakable, full)
        return graphs, [r for r in (full, breakable, eager) if r is not None]

    def _log_ready(self) -> None:
        m = self.memory
        if self.device.type != "cuda":
            sized = (f"KV_CACHE_BYTES={self.cfg.kv_cache_bytes}" if self.cfg.kv_cache_bytes
                     else "two prompts of the longest accepted length (KV_CACHE_BYTES unset)")
            log.info("engine ready on cpu: eager forwards on the PyTorch reference kernels with "
                     "%d threads, no CUDA graphs; KV pool sized for %s: %d tokens (%s)",
                     torch.get_num_threads(), sized, m.kv_tokens, gib(m.kv_bytes))
            return
        mode = (f"CUDA graphs ({len(m.buckets)} buckets up to {max(m.buckets)} tokens, "
                f"{m.graphs} graphs)" if m.buckets else "eager (CUDA graphs off)")
        log.info("engine ready on %s: %s, Triton kernels; weights %s, capture %s, KV pool %d "
                 "tokens (%s), reserve %s at MEM_FRACTION_STATIC=%.2f", self.device, mode,
                 gib(m.weights_bytes), gib(m.capture_bytes), m.kv_tokens, gib(m.kv_bytes),
                 gib(m.reserve_bytes), m.mem_fraction_static)

    def warm_up(self) -> None:
        """Compile the kernel variants capture does not reach, so no request waits for the JIT."""
        graphs = self.graphs
        if graphs is None or not graphs.buckets or isinstance(self.runners[0], DPRunner):
            return
        counts, runs = dict(self.forward_counts), dict(self.runs)
        t0 = time.perf_counter()
        try:
            for chunks in warm_up_batches(self.cfg.cuda_graph_full_max_seqs,
                                          self.pool.page_size, self.max_batch_tokens,
                                          self.model.max_positions):
                if graphs.breakable.can_run(chunks, sum(c.num_tokens for c in chunks)):
                    self.forward(chunks)
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - serving works without it: kernels compile on first use
            log.warning("warm-up forward failed; the kernels it would have compiled compile on "
                        "first use instead", exc_info=True)
        finally:
            self.forward_counts.update(counts)
            self.runs.update(runs)
        log.info("warm-up forwards: %.2f s", time.perf_counter() - t0)

    def info(self) -> EngineInfo:
        c, size = self.model_cfg, self.dtype.itemsize
        return EngineInfo(self.model_path, c.arch, c.vocab_size, self.model.max_positions,
                          self.pool.page_size, self.pool.capacity_tokens, self.memory,
                          device_name=(torch.cuda.get_device_name(self.device)
                                       if self.device.type == "cuda" else "cpu"),
                          kv_bytes_per_token=c.kv_bytes_per_token(size),
                          windowed_kv_bytes_per_token=c.kv_bytes_per_token(size, True),
                          quantization=self.precision)

    @property
    def max_batch_tokens(self) -> int:
        return self.cfg.max_prefill_tokens

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.graphs.buckets if self.graphs is not None else ()

    @torch.inference_mode()
    def launch(self, chunks: list[SeqChunk]) -> Launched:
        """Queue a forward and its last rows' way to the host; returns without waiting for it."""
        t0 = time.perf_counter()
        tokens = sum(c.num_tokens for c in chunks)
        assert tokens <= self.max_batch_tokens, (
            f"batch of {tokens} tokens exceeds MAX_PREFILL_TOKENS={self.max_batch_tokens}")
        assert all(c.num_tokens for c in chunks), "every chunk needs at least one new token"
        runner = next(r for r in self.runners if r.can_run(chunks, tokens))
        logits, batch, mode = runner.run(chunks, self.pool.cache)
        self.forward_counts[mode] += 1
        self.runs[runner.name] += 1
        summary = batch.summary
        if summary is None and batch.logits_rows:
            summary = HostCopy(summarize(logits.index_select(0, batch.last_rows)))
        named = None
        if asking := [i for i, c in enumerate(chunks) if c.named]:
            rows = [batch.logits_rows[i][1] - 1 for i in asking]
            named = asking, HostCopy(named_rows(logits, rows, [chunks[i].named for i in asking]))
        return Launched([logits[s:e] for s, e in batch.logits_rows], summary, mode, t0, named)

    def forward(self, chunks: list[SeqChunk]) -> ForwardOutput:
        return self.launch(chunks).wait()

    def prefill_chunked(self, token_ids: list[int], chunk_tokens: int | None = None
                        ) -> torch.Tensor:
        """One prompt prefilled `chunk_tokens` at a time (tests, benches); last logits (vocab,)."""
        step = chunk_tokens or self.max_batch_tokens
        pages = self.pool.allocator.alloc(pages_for(len(token_ids), self.pool.page_size))
        try:
            out = None
            for s in range(0, len(token_ids), step):
                e = min(s + step, len(token_ids))
                chunk = SeqChunk(tuple(token_ids[s:e]), s,
                                 tuple(pages[: pages_for(e, self.pool.page_size)]))
                out = self.forward([chunk]).logits[0][-1]
            return out
        finally:
            self.pool.allocator.free(pages)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
