"""y = x @ W[layer]^T (+ bias[layer]) with `layer` read on the device: one GEMM for every layer.

Why: a CUDA graph bakes its kernels' pointers in, so a segment graph that runs layer i's dense
work can only serve layer i, and the breakable runner holds buckets x layers graphs. Each costs
~130 KB of driver memory however small it is (bench/graph_memory.py on the H200), which is most
of SmolLM2-135M's capture memory. With every layer's weights stacked in one (L, N, K) tensor and
the layer number in a device scalar, one captured segment serves all the middle layers.

Algorithm: the Triton tutorial's tiled matmul (fp32 accumulate, one rounding to the output
dtype) with the weight's base pointer offset by (layer[0] + offset) * stride. Sized for the
small buckets it serves (a few to a few hundred rows): tiles are chosen so the grid fills the
GPU (weights are read once per row tile, so the small-M case is bound by weight bandwidth and
needs many programs), see `pick_tiles`.

Shapes: x (M, K) rows may be strided, last dim contiguous; w (L, N, K) contiguous; bias (L, N)
or None; layer int32 (1,) on the device; out (M, N) contiguous last dim.
"""

from __future__ import annotations

import torch

from kernels._triton import dot, dot_flags, tl, triton


@triton.jit
def _indexed_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    layer_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wl,
    stride_bl,
    stride_om,
    LAYER_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    layer = (tl.load(layer_ptr) + LAYER_OFFSET).to(tl.int64)
    w_ptr += layer * stride_wl
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # (BLOCK_K, BLOCK_N) = W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
        acc = dot(x, w, acc, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b = tl.load(b_ptr + layer * stride_bl + rn, mask=rn < N, other=0.0)
        acc += b.to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:  # out += x @ W^T: each element is read and written by this program only
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def pick_tiles(M: int, N: int, K: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): row tiles no taller than M needs
    (16..64), then the widest column tile that still gives every SM a program (down to 32),
    K in steps of 128, 3 stages. From bench/indexed_linear.py on the H200: at 16 and 64 rows this
    rule is within 5 % of the best of 13 tile sets in 28 of 32 (model, linear, rows) cases; the
    misses are Llama-3.1-8B's qkv and down, where another tile set is up to 1.33x faster
    (bench/results/indexed-linear-h200-2026-11-29.md)."""
    bm = min(64, max(16, triton.next_power_of_2(M)))
    m_tiles = triton.cdiv(M, bm)
    bn = 32
    for cand in (128, 64):
        if triton.cdiv(N, cand) * m_tiles >= sms:
            bn = cand
            break
    return bm, bn, 128 if K >= 128 else 64, 4, 3


def indexed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   layer: torch.Tensor, offset: int = 0, out: torch.Tensor | None = None, *,
                   accumulate: bool = False,
                   tiles: tuple[int, int, int, int, int] | None = None, wrap=None
                   ) -> torch.Tensor:
    """x (M, K) @ w[layer + offset]^T (+ bias[layer + offset]) -> out (M, N), x's dtype.
    `accumulate`: out += that instead (the sum in fp32, rounded once), like Tensor.addmm_."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be (M, K) with a contiguous last dim"
    assert w.dim() == 3 and w.is_contiguous() and w.shape[2] == x.shape[1], (
        f"w must be a contiguous (L, N, K) stack matching x's K, got {tuple(w.shape)}")
    assert w.dtype == x.dtype, f"x {x.dtype} vs w {w.dtype}"
    assert layer.dtype == torch.int32 and layer.numel() == 1, "layer: one int32 on the device"
    M, K = x.shape
    N = w.shape[1]
    if bias is not None:
        assert bias.shape == w.shape[:2] and bias.stride(1) == 1, "bias must be (L, N)"
    if out is None:
        assert not accumulate, "accumulate needs an out"
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype, "bad out"
    if M == 0:
        return out
    if tiles is None:
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            tiles = pick_tiles(M, N, K, sms)
        else:  # the interpreter: smallest legal tiles
            tiles = (16, 16, 16, 1, 1)
    bm, bn, bk, warps, stages = tiles
    kernel = wrap(_indexed_linear_kernel) if wrap is not None else _indexed_linear_kernel
    kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, bias if bias is not None else w, out, layer, M, N, K, x.stride(0), w.stride(0),
        bias.stride(0) if bias is not None else 0, out.stride(0), LAYER_OFFSET=offset,
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, **dot_flags(x.dtype, x.device.type),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def indexed_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                       layer: torch.Tensor, offset: int = 0, out: torch.Tensor | None = None,
                       accumulate: bool = False) -> torch.Tensor:
    """PyTorch reference: the layer picked on the device (index_select: no host sync)."""
    i = layer.long() + offset
    wi = w.index_select(0, i)[0]
    b = None if bias is None else bias.index_select(0, i)[0]
    if accumulate:
        assert out is not None, "accumulate needs an out"
        y = out.float() + torch.nn.functional.linear(x.float(), wi.float(),
                                                     None if b is None else b.float())
        return out.copy_(y)
    y = torch.nn.functional.linear(x, wi, b)
    if out is None:
        return y
    out.copy_(y)
    return out
