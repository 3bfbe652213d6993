"""The ways a batch can run (`run() -> (logits, batch, mode)`) and the helpers they share."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import torch

from service.engine.host_copy import to_device

if TYPE_CHECKING:  # service.engine.batch imports this package's packing
    from service.engine.batch import PrefillBatch, SeqChunk
    from service.model.decoder import DecoderModel
    from service.model.meta import KVCache

Chunks = Sequence["SeqChunk"]


class Runner(Protocol):
    name: str

    def can_run(self, chunks: Chunks, tokens: int) -> bool: ...
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]: ...


def picked_rows(model: DecoderModel, batch: PrefillBatch, chunks: Chunks
                ) -> torch.Tensor | None:
    """Where the LM head keeps the normed rows it reads, when a chunk asks for its hidden row."""
    if not any(c.hidden for c in chunks):
        return None
    return torch.empty(batch.meta.logits_indices.shape[0], model.cfg.hidden_size,
                       dtype=model.dtype, device=model.device)


def with_hidden(batch: PrefillBatch, picked: torch.Tensor | None) -> PrefillBatch:
    return batch if picked is None else dataclasses.replace(batch, hidden=picked)


def pools(chunks: Chunks) -> bool:
    return any(c.pool for c in chunks)


def pooled_rows(hidden: torch.Tensor, cu: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """Per chunk asking `pool`: fp32 (D,) sum of its rows (mean) or its first row (cls)."""
    b, t = len(chunks), sum(c.num_tokens for c in chunks)
    asking = [(int(c.pool == "cls"), i) for i, c in enumerate(chunks) if c.pool]
    pick = to_device(torch.tensor(asking, dtype=torch.int64).T.contiguous(), hidden.device)
    out = torch.zeros(2, b, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if any(c.pool == "mean" for c in chunks):
        rows = torch.arange(t, dtype=cu.dtype, device=cu.device)
        seg = torch.searchsorted(cu[1:b + 1], rows, right=True)  # (t,) each row's chunk
        out[0].index_add_(0, seg, hidden[:t].float())
    if any(c.pool == "cls" for c in chunks):
        out[1] = hidden.index_select(0, cu[:b].clamp(max=max(t - 1, 0))).float()
    return out[pick[0], pick[1]]  # (asking, D)


def with_pooled(batch: PrefillBatch, hidden: torch.Tensor, chunks: Chunks) -> PrefillBatch:
    """`batch` with its pooled rows reduced from `hidden` (final-norm rows), if a chunk asks."""
    if not pools(chunks):
        return batch
    return dataclasses.replace(batch, pooled=pooled_rows(hidden, batch.meta.cu_seqlens_q, chunks))


@contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run on `stream`, ordered after the caller's stream's earlier work and before its later."""
    if stream is None or torch.cuda.current_stream(stream.device) == stream:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


@contextmanager
def gc_paused() -> Iterator[None]:
    """NOTE: a GC mid-capture can free CUDA graphs or events, which invalidates the capture."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def eager_peak_bytes(device: torch.device, run) -> int:  # noqa: ANN001 - a () -> None
    """Activation peak (bytes) of `run()`; 0 off CUDA (it still runs)."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak
