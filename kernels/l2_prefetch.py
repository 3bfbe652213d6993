"""Read tensors into the GPU's L2 cache ahead of the kernels that need them.

Why: a small prompt's full CUDA graph (service.engine.full_graph) runs each GEMM on few rows,
so a GEMM's time is latency, not bandwidth: its weight tiles arrive from HBM while the SMs
wait. A small model's next segment of weights (SmolLM2-135M: ~7 MB a layer) fits in L2 many
times over (50 MB on an H100/H200), so a kernel on a second stream, captured beside the
forward, can read layer i + 1's weights while layer i computes; its GEMMs then read them from
L2. No effect on values: nothing is written (see below).

Algorithm: every program reads BLOCK-element strips of each tensor, PROGRAMS strips apart
(grid-stride), with an L2 evict-last hint, and folds them into an XOR it never stores unless
it equals a value the caller picks as never occurring in practice (`sink` is written then, and
only then): a load whose value reaches a store cannot be removed by the compiler.

Shapes: up to four 1-D int32 views (`as_words`) of contiguous tensors; `sink` (PROGRAMS,) int32.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

MAX_TENSORS = 4
_MAGIC = 0x5A17C0DE  # the XOR a sink store needs: never reached on real weights in practice


@triton.jit
def _strips(ptr, n, acc, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        x = tl.load(ptr + start + offs, mask=start + offs < n, other=0,
                    eviction_policy="evict_last")
        acc ^= x
    return acc


@triton.jit
def _l2_prefetch_kernel(a_ptr, na, b_ptr, nb, c_ptr, nc, d_ptr, nd, sink_ptr, magic,
                        BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    acc = _strips(a_ptr, na, acc, BLOCK)
    acc = _strips(b_ptr, nb, acc, BLOCK)
    acc = _strips(c_ptr, nc, acc, BLOCK)
    acc = _strips(d_ptr, nd, acc, BLOCK)
    folded = tl.xor_sum(acc, axis=0)
    if folded == magic:
        tl.store(sink_ptr + tl.program_id(0), folded)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as 1-D int32 (a trailing odd 2-byte element is left out:
    prefetching is a hint, so a missed half-word changes nothing)."""
    assert t.is_contiguous(), "prefetch reads contiguous tensors"
    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // 4 * 4].view(torch.int32)


def l2_prefetch(words: list[torch.Tensor] | tuple[torch.Tensor, ...], sink: torch.Tensor,
                block: int = 2048, num_warps: int = 4) -> None:
    """Queue reads of up to MAX_TENSORS `as_words` views on the current stream, with
    sink.numel() programs. Writes nothing (see the module note)."""
    assert 0 < len(words) <= MAX_TENSORS, f"1 to {MAX_TENSORS} tensors, got {len(words)}"
    assert sink.dim() == 1 and sink.dtype == torch.int32 and sink.numel() > 0
    for w in words:
        assert w.dim() == 1 and w.dtype == torch.int32, "pass as_words views"
    args: list = []
    for w in (*words, *(words[0],) * (MAX_TENSORS - len(words))):
        args += [w, w.numel() if len(args) // 2 < len(words) else 0]
    _l2_prefetch_kernel[(sink.numel(),)](*args, sink, _MAGIC, BLOCK=block, num_warps=num_warps)


def l2_prefetch_ref(words, sink: torch.Tensor, **_) -> None:
    """Reference: a prefetch has no effect on values, so there is nothing to compute."""
