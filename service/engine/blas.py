"""cuBLAS as the engine's graphs use it: no cuBLAS workspace, cuBLASLt for the full graphs.

With a workspace, cuBLAS's Hopper GEMMs at prefill's row counts clear part of it before each
GEMM: a memset node in front of most projections of a captured graph, and every memset node
leaves the GPU idle ~3 us where two kernels leave ~0.4 (64 a forward in Llama-3.2-1B, 60 in
SmolLM2-135M). Without one, cuBLAS picks kernels that need none, as fast or faster at these
shapes, and the memsets are gone: 8,192-token forwards 1-4 % faster on an H200. cuBLASLt,
which the full graphs capture with, keeps a workspace of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The full graphs' library: small batches are bound by launches, and cuBLASLt runs fewer
# kernels there.
FULL_GRAPH_BLAS = "cublaslt"

# PyTorch reads these once, at the process's first GEMM; a value set by the user stands.
CUBLAS_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":0:0",  # no cuBLAS workspace
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0",  # cuBLASLt then sizes its own, not cuBLAS's (0)
    "CUBLASLT_WORKSPACE_SIZE": "32768",  # KiB: PyTorch's cuBLAS default on Hopper
}


def configure_cublas() -> None:
    """Before the process's first GEMM (later calls change nothing the running process uses)."""
    for key, value in CUBLAS_ENV.items():
        os.environ.setdefault(key, value)


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
