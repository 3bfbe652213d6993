"""EngineCore: its start-up sequence, then forwards on the first runner that accepts them."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from kernels.extend_attention_config import prefix_batch_rows
from service.config import EngineConfig
from service.engine.batch import SeqChunk
from service.engine.dp import DPGroup, placement
from service.engine.host_copy import HostCopy, to_device
from service.engine.interface import EngineInfo, MemoryReport
from service.engine.kv_pool import KVPool
from service.engine.memory import (
    InsufficientMemory,
    MemoryReader,
    cpu_kv_tokens,
    cpu_report,
    cuda_free_bytes,
    gib,
    size_kv,
)
from service.engine.pages import pages_for
from service.engine.placement import prepared
from service.engine.runners.capture import capture, eager_peak, settle
from service.engine.sampling import LastRow, named_rows, summarize, unpack
from service.kv_transfer.export import export_bytes
from service.model.heads import head_info
from service.model.loader import LoadedModel, load
from service.model.pooling import resolve

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

__all__ = ["EngineCore", "ForwardOutput", "InsufficientMemory", "Launched", "MemoryReport"]


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor]  # per chunk: (rows, vocab) fp32 on the model's device
    last: list[LastRow]  # per chunk: its last row's greedy token and top logprobs, on the host
    mode: str
    seconds: float
    hidden: dict[int, torch.Tensor] = {}  # chunk -> its last row's final-norm hidden (host)
    pooled: dict[int, torch.Tensor] = {}  # chunk -> its `pool` reduction, fp32 (host)
    scores: dict[int, torch.Tensor] = {}  # chunk -> its score head's logits, fp32 (host)


class Launched:
    """A queued forward; its logits are its own, so the next may launch before its `wait()`."""

    __slots__ = ("logits", "summary", "named", "hidden", "pooled", "scores", "mode", "t0")

    def __init__(self, logits: list[torch.Tensor], summary: HostCopy | None, mode: str,
                 t0: float, named: tuple[list[int], HostCopy] | None = None,
                 hidden: tuple[list[int], HostCopy] | None = None,
                 pooled: tuple[list[int], HostCopy] | None = None,
                 scores: tuple[list[int], HostCopy] | None = None):
        self.logits, self.summary, self.mode, self.t0 = logits, summary, mode, t0
        self.named, self.hidden, self.pooled, self.scores = named, hidden, pooled, scores

    def ready(self) -> bool:
        return all(c is None or c.ready() for c in (self.summary, self.named and self.named[1],
                                                    self.hidden and self.hidden[1],
                                                    self.pooled and self.pooled[1],
                                                    self.scores and self.scores[1]))

    def wait(self) -> ForwardOutput:
        last = unpack(self.summary.get()) if self.summary is not None else []
        if self.named is not None:
            chunks, copy = self.named
            for i, vals in zip(chunks, copy.get().tolist()):
                last[i].named = vals
        hidden, pooled, scores = ({} if c is None else dict(zip(c[0], c[1].get().unbind(0)))
                                  for c in (self.hidden, self.pooled, self.scores))
        return ForwardOutput(self.logits, last, self.mode, time.perf_counter() - self.t0, hidden,
                             pooled, scores)


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
        self.cfg, self.device, self.dtype = cfg, torch.device(cfg.device), _DTYPES[cfg.dtype]
        self.placement = placement(dp_group)
        reader, free_before = self._measure_free_memory(memory_reader)
        self._load(loaded)
        self._build_runners()
        if reader is None:
            report = self._size_cpu_kv()
        else:
            scratch, peak = self._eager_peak()
            free_pre, capture_s = capture(self.graphs, scratch.cache, reader)
            del scratch  # NOTE: freed before the sizing reads what is free after capture
            report = self._size_kv(reader, (free_before, free_pre), peak, capture_s)
        self._allocate_kv(report)
        self.warm_up()
        self._log_ready()

    def _measure_free_memory(self, memory_reader: MemoryReader | None
                             ) -> tuple[MemoryReader | None, int]:
        """The free-memory reader (None on the CPU) and its reading before loading."""
        if self.cfg.cpu_threads:
            torch.set_num_threads(self.cfg.cpu_threads)
        cuda = self.device.type == "cuda"
        reader = memory_reader or (cuda_free_bytes(self.device) if cuda else None)
        return reader, reader() if reader is not None else 0

    def _load(self, loaded: LoadedModel | None) -> None:
        """The model with its QUANTIZATION scheme applied, prepared for this placement."""
        cfg = self.cfg
        loaded = prepared(loaded or load(cfg.model_path, cfg.model_preset, self.device,
                                         self.dtype, cfg.pooling, cfg.score_head), cfg,
                                    self.placement)
        self.model, self.tokenizer, self.model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self.model_path, self.precision = str(loaded.path), self.model.scheme.label
        self.pooling = resolve(loaded.path, cfg.pooling, cfg.normalize)
        self.lm_head = loaded.lm_head

    def _build_runners(self) -> None:
        """The forward stream and this placement's runners, graphs not yet captured."""
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.synchronous = not cuda  # on the CPU a launch runs the whole forward
        self.graphs, self.runners = self.placement.runners(self.model, self.cfg, self.stream)
        self.forward_counts = {"graph": 0, "eager": 0}
        self.runs = {r.name: 0 for r in self.runners}

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _eager_peak(self) -> tuple[KVPool, int]:
        """A scratch KV pool for capture and the activation peak of the largest eager batch."""
        return eager_peak(self.model, self.runners[-1], self.stream, self.cfg.page_size,
                          self.cfg.max_prefill_tokens)

    def _size_kv(self, reader: MemoryReader, free: tuple[int, int], peak: int, capture_s: float
                 ) -> MemoryReport:
        """The KV budget from free memory before loading, before and after capture."""
        cfg = self.cfg
        settle(self.device)
        # KV_TRANSFER's export region is allocated after the pool: its bytes come out of the KV's
        held = export_bytes(self.model_cfg, cfg.kv_transfer_tokens, cfg.page_size,
                            self.dtype.itemsize) if cfg.kv_transfer != "none" else 0
        return size_kv(self.model_cfg, self.dtype, self.device, self.graphs,
                       (*free, reader() - held),
                       self.weights_bytes, peak, capture_s, cfg.mem_fraction_static,
                       cfg.page_size, cfg.max_prefill_tokens)

    def _size_cpu_kv(self) -> MemoryReport:
        """Without a memory reader: KV_CACHE_BYTES, else two prompts of the longest length."""
        cfg = self.cfg
        tokens = cpu_kv_tokens(self.model_cfg, self.dtype.itemsize, cfg.page_size,
                               min(cfg.max_prompt_tokens, self.model.max_positions),
                               cfg.kv_cache_bytes)
        return cpu_report(self.weights_bytes, cfg.mem_fraction_static, tokens)

    def _allocate_kv(self, report: MemoryReport) -> None:
        """The KV pool at its final address, and the memory report with its real size."""
        self.pool = KVPool(self.model_cfg, report.kv_tokens, self.cfg.page_size, self.dtype,
                           self.device)
        if self.stream is not None:
            torch.cuda.synchronize(self.device)  # the pool's zero-fill, before the stream uses it
        self.memory = dataclasses.replace(report, kv_bytes=self.pool.nbytes,
                                          kv_tokens=self.pool.capacity_tokens)

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
        if graphs is None or not graphs.buckets or not self.placement.warms_up:
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
                          quantization=self.precision, pooling=self.pooling.mode,
                          normalize=self.pooling.normalize, lm_head=self.lm_head,
                          **head_info(self.model.score_head))

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
        hidden = scores = None
        if asking := [i for i, c in enumerate(chunks) if c.hidden and not c.head]:
            rows = torch.tensor([batch.logits_rows[i][1] - 1 for i in asking])
            hidden = asking, HostCopy(batch.hidden.index_select(0, to_device(rows, self.device)))
        if asking := [i for i, c in enumerate(chunks) if c.head]:
            rows = torch.tensor([batch.logits_rows[i][1] - 1 for i in asking])
            picked = batch.hidden.index_select(0, to_device(rows, self.device))  # (n, hidden)
            scores = asking, HostCopy(self.model.score(picked))  # (n, labels) fp32
        pooled = None
        if asking := [i for i, c in enumerate(chunks) if c.pool]:
            assert batch.pooled is not None, f"runner {runner.name} ran a pooling chunk"
            pooled = asking, HostCopy(batch.pooled)
        return Launched([logits[s:e] for s, e in batch.logits_rows], summary, mode, t0, named,
                        hidden, pooled, scores)

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
