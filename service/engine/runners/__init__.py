"""The ways a batch can run, behind one small interface, and the helpers they share.

The engine asks its runners in order (full graph, breakable graphs, eager) and the first whose
`can_run` accepts the batch runs it: `run(chunks, kv) -> (logits, batch, mode)`, with the
logits (rows, vocab) fp32 on the device and `mode` "graph" or "eager".
"""

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
    """Run on `stream` (warm-up, capture, replay and eager work all share it: one cuBLAS
    workspace), ordered after the caller's stream's earlier work (weights, KV pool) and before
    its later work. A no-op without a stream or when it is already current."""
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
    """Collect garbage once, then keep Python's GC from running during capture.

    NOTE: a collection in the middle of a capture can destroy unrelated CUDA graphs or events
    (cyclic garbage), whose teardown is illegal while a stream is being captured: the capture is
    invalidated (CUBLAS_STATUS_EXECUTION_FAILED). SGLang and vLLM pause the GC for this reason.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def eager_peak_bytes(device: torch.device, run) -> int:  # noqa: ANN001 - a () -> None
    """Activation peak (bytes) of `run()`, an eager forward; 0 off CUDA (it still runs)."""
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
