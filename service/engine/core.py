"""EngineCore: load → warm up → capture → size the KV pool → forward batches.

No HTTP, no metrics here: the scheduler drives it from one worker thread, and everything it
exposes for metrics is plain numbers (`MemoryReport`, `forward_counts`). On CUDA the KV pool is
allocated after graph capture from the memory then free (service.engine.memory); on a machine
without a GPU the same code runs eagerly on the PyTorch reference kernels and the pool is sized
from KV_CACHE_BYTES.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.extend_attention_config import tile_thresholds
from service.config import EngineConfig
from service.engine.batch import SeqChunk
from service.engine.buckets import Buckets, resolve_buckets
from service.engine.dp import DPGroup
from service.engine.graph import CudaGraphBackend
from service.engine.kv_pool import KVPool
from service.engine.memory import (
    InsufficientMemory,
    MemoryReader,
    MemoryReport,
    cuda_free_bytes,
    gib,
    size_after_capture,
)
from service.engine.pages import pages_for
from service.engine.runner import FullGraphSpec, PrefillRunner
from service.engine.sampling import LastRow, last_rows, unpack
from service.model.config import preset
from service.model.loader import LoadedModel, default_model_path, load_model, random_model

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

__all__ = ["EngineCore", "ForwardOutput", "InsufficientMemory", "MemoryReport"]


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor]  # per chunk: (rows, vocab) fp32 on the model's device
    last: list[LastRow]  # per chunk: its last row's greedy token and top logprobs, on the host
    mode: str  # "graph" | "eager"
    seconds: float


def warm_up_batches(full_max_seqs: int, page_size: int, max_tokens: int, max_positions: int
                    ) -> list[list[SeqChunk]]:
    """EngineCore.warm_up's batches, every KV row on the dummy page, each prompt after a
    one-page cached prefix: more prompts than a full graph takes (the breakable path and its
    eager LM head, small attention tiles); one prompt of more new tokens than the small tiles
    cover (the table's tiles); one at the row count where the table's tiles read with TMA
    (kernels/extend_attention_config.tile_thresholds). Those that do not fit the batch budget
    or the context are left out."""
    def prompt(n: int) -> SeqChunk:
        return SeqChunk.of([1] * n, page_size, [0] * pages_for(page_size + n, page_size))

    small, tma = tile_thresholds()
    out = [[prompt(16) for _ in range(full_max_seqs + 1)], [prompt(small + 16)],
           [prompt(tma + 16)]]
    return [b for b in out if sum(c.num_tokens for c in b) <= max_tokens
            and page_size + max(c.num_tokens for c in b) <= max_positions]


def weights_nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _tokenizer_of(path: Path):
    """Only the tokenizer of a checkpoint (random-weight presets keep the real vocabulary)."""
    from service.model.loader_gguf import gguf_metadata, read_gguf
    from service.model.loader_hf import read_hf_config
    from service.model.tokenizer import load_hf_tokenizer, tokenizer_from_gguf

    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_tokenizer(path, read_hf_config(path)[1])
    if path.is_dir():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    return tokenizer_from_gguf(gguf_metadata(read_gguf(path)), str(path))


def load(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if cfg.model_preset is None:
        return load_model(cfg.model_path, device, dtype)
    t0 = time.perf_counter()
    path = Path(cfg.model_path) if cfg.model_path else default_model_path()
    mcfg = preset(cfg.model_preset)
    model = random_model(mcfg, device, dtype)
    return LoadedModel(model, _tokenizer_of(path), mcfg, path, time.perf_counter() - t0)


class EngineCore:
    """`loaded` injects a model (tests); `memory_reader` fakes device memory; `dp_group` makes
    this process one rank of a data-parallel group (every rank calls `forward` in lockstep)."""

    def __init__(self, cfg: EngineConfig, *, loaded: LoadedModel | None = None,
                 memory_reader: MemoryReader | None = None, dp_group: DPGroup | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = _DTYPES[cfg.dtype]
        cuda = self.device.type == "cuda"
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        if cfg.dp_size > 1 and (dp_group is None or dp_group.world != cfg.dp_size):
            raise ValueError(f"DP_SIZE={cfg.dp_size} needs one process per rank joined in a "
                             "DPGroup (service.engine.dp.init_dp) passed as dp_group")
        reader = memory_reader or (cuda_free_bytes(self.device) if cuda else None)
        free_before = reader() if reader is not None else 0
        loaded = loaded or load(cfg, self.device, self.dtype)
        self.model, self.tokenizer, self.model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self.model.attn.hopper = cfg.attention_hopper_kernel
        self.model_path = str(loaded.path)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        sizes = resolve_buckets(cfg.cuda_graph_buckets, cfg.cuda_graph_max_tokens,
                                cfg.max_prefill_tokens) if cuda else ()
        backend = CudaGraphBackend(self.stream) if sizes else None
        context = min(cfg.max_prompt_tokens, self.model.max_positions)
        full = FullGraphSpec(cfg.cuda_graph_full_max_tokens, cfg.cuda_graph_full_max_seqs,
                             pages_for(context, cfg.page_size), cfg.cuda_graph_full_blas)
        self.runner = PrefillRunner(self.model, Buckets(sizes), backend, dp=dp_group,
                                    stream=self.stream,
                                    shared_max_tokens=cfg.cuda_graph_shared_max_tokens,
                                    full=full, fold_norms=cfg.fold_norms)
        self.forward_counts = self.runner.forward_counts
        weights = weights_nbytes(self.model)
        if reader is not None:
            report, plan = size_after_capture(self.runner, reader, free_before, weights,
                                              cfg.mem_fraction_static, cfg.page_size,
                                              cfg.max_prefill_tokens)
            kv_tokens = plan.tokens
        elif cfg.kv_cache_bytes is None:  # room for two prompts of the longest accepted length
            kv_tokens = 2 * pages_for(context, cfg.page_size) * cfg.page_size
        else:
            bpt = self.model_cfg.kv_bytes_per_token(self.dtype.itemsize)
            kv_tokens = max(cfg.kv_cache_bytes // bpt // cfg.page_size - 1, 2) * cfg.page_size
        if reader is None:
            report = MemoryReport(
                free_before_bytes=0, weights_bytes=weights, capture_bytes=0,
                retained_input_bytes=0, kv_bytes=0, kv_tokens=0, reserve_bytes=0,
                eager_peak_bytes=0, mem_fraction_static=cfg.mem_fraction_static,
                capture_seconds=0.0, path="cpu")
        self.pool = KVPool(self.model_cfg, kv_tokens, cfg.page_size, self.dtype, self.device)
        if cuda:
            torch.cuda.synchronize(self.device)  # the pool's zero-fill, before the stream uses it
        self.memory = dataclasses.replace(report, kv_bytes=self.pool.nbytes,
                                          kv_tokens=self.pool.capacity_tokens)
        self.warm_up()
        self._log_ready()

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
        """Compile, before the first request, the kernel variants that capture does not reach,
        so that no request waits for Triton's JIT: the eager LM head's first-token reductions
        (the breakable path's) and attention over a cached prefix (prefix-cache hits, later
        chunks of a long prompt) with the small- and the large-batch tiles. On the H200, a
        fresh process's first breakable forward took 241 ms and its first prompt over 1,024
        tokens 892 ms, against 3-4 ms each after (bench/results/first-call-s11-*). The
        forwards write KV only to the dummy page and are not counted. CUDA graphs only; not
        with data parallelism (ranks would have to warm up in lockstep: they compile on their
        first batches instead)."""
        if self.device.type != "cuda" or not self.runner.captured or self.runner.dp is not None:
            return
        counts, full = dict(self.runner.forward_counts), self.runner.full_forwards
        t0 = time.perf_counter()
        try:
            for chunks in warm_up_batches(self.cfg.cuda_graph_full_max_seqs,
                                          self.pool.page_size, self.max_batch_tokens,
                                          self.model.max_positions):
                if self.runner.can_use_graph(sum(c.num_tokens for c in chunks)):
                    self.forward(chunks)
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - serving works without it: kernels compile on first use
            log.warning("warm-up forward failed; the kernels it would have compiled compile on "
                        "first use instead", exc_info=True)
        finally:
            self.runner.forward_counts.update(counts)
            self.runner.full_forwards = full
        log.info("warm-up forwards: %.2f s", time.perf_counter() - t0)

    @property
    def max_batch_tokens(self) -> int:
        return self.cfg.max_prefill_tokens

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.runner.captured

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> ForwardOutput:
        """Logits stay on the device; every chunk's last row (the first token needs it) is
        reduced there in one batch and only that summary crosses to the host."""
        t0 = time.perf_counter()
        tokens = sum(c.num_tokens for c in chunks)
        assert tokens <= self.max_batch_tokens, (
            f"batch of {tokens} tokens exceeds MAX_PREFILL_TOKENS={self.max_batch_tokens}")
        assert all(c.num_tokens for c in chunks), "every chunk needs at least one new token"
        logits, batch, mode = self.runner.prefill(chunks, self.pool.cache)
        rows = batch.logits_rows
        if batch.summary is not None:  # reduced inside a full graph
            last = unpack(batch.summary)
        elif rows:
            # (B, vocab): every chunk's last row. NOTE: a device index; a Python list would be
            # copied from pageable memory, which waits for the whole forward before the host
            # can queue these reductions.
            last = last_rows(logits.index_select(0, batch.last_rows))
        else:
            last = []
        return ForwardOutput([logits[s:e] for s, e in rows], last, mode,
                             time.perf_counter() - t0)

    def prefill_chunked(self, token_ids: list[int], chunk_tokens: int | None = None
                        ) -> torch.Tensor:
        """One prompt, prefilled `chunk_tokens` at a time, each chunk attending to the KV the
        earlier ones wrote; returns the last token's logits (vocab,) on the model's device. For
        tests and benches: the scheduler splits long prompts itself."""
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
        """Free the graphs, their pool and the static buffers (the KV pool stays readable)."""
        self.runner.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
