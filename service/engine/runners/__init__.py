"""The ways a batch can run (`run() -> (logits, batch, mode)`) and the helpers they share."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import torch

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
    """Whether a chunk asks for mean/cls pooling: every row's hidden state, which only the
    eager runner keeps."""
    return any(c.pool for c in chunks)


def pooled_rows(hidden: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """Per chunk asking `pool`: fp32 (D,) sum of its rows (mean) or its first row (cls)."""
    out, start = [], 0
    for c in chunks:
        rows = hidden[start:start + c.num_tokens]  # (n, D)
        start += c.num_tokens
        if c.pool == "mean":
            out.append(rows.float().sum(0))
        elif c.pool == "cls":
            out.append(rows[0].float())
    return torch.stack(out)  # (asking, D)


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
