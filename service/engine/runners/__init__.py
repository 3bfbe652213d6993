"""The ways a batch can run, behind one small interface, and the helpers they share.

The first runner whose `can_run` accepts a batch runs it: `run() -> (logits, batch, mode)`."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from service.engine.batch import PrefillBatch, SeqChunk
from service.model.meta import KVCache

Chunks = Sequence[SeqChunk]


class Runner(Protocol):
    name: str  # "full" | "breakable" | "eager" | "dp"

    def can_run(self, chunks: Chunks, tokens: int) -> bool: ...
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]: ...


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
