"""Hopper (sm_90) path of extend attention for prefix-free batches, written in Gluon.

Why a second kernel: Triton 3.6 compiles the plain kernel's inner loop into QK^T -> wait ->
softmax -> PV -> wait with a CTA-wide barrier every iteration, so a CTA's two warpgroups run in
lockstep and the tensor cores idle during every softmax (its SASS, compiled for sm_90; its
warp-specialization pass asserts on the kernel). This one is warp-specialized by hand, as
FlashAttention-3 is: a producer warpgroup streams K/V tiles through a ring of shared-memory
stages with TMA and mbarriers, and two consumer warpgroups of 64 query rows each (one CTA = 128
rows) run QK^T, the exp2 online softmax and PV on their own schedule, so one's softmax overlaps
the other's tensor-core work. No CTA-wide barrier inside the loop. Within a warpgroup QK^T of
block j is issued together with PV of block j-1 and the softmax of j runs under PV(j-1)
(`_overlapped`, FA3's in-warpgroup pipelining). H200, causal, D=128, 32q/8kv heads, TFLOP/s at
S = 4k / 8k / 16k: 537 / 579 / 598 against 412 / 464 / 498 for the plain kernel and 509 / 548 /
575 for SDPA's cuDNN backend (bench/results/attention-s4-h200-2026-11-29.md).

Scope: causal attention of each sequence's new tokens to themselves (no cached prefix), GQA,
head_dim 64/128, bf16/fp16 in, fp32 accumulate; no lse. Same contract as the plain kernel
otherwise: varlen batch through cu_seqlens_q, rows may be strided slices of a fused qkv buffer,
rows past a sequence are never written. The grid and the longest-first order match it too.
Its PyTorch reference is `extend_attention_ref` (kernels/extend_attention.py) with no prefix,
which the tests compare it against.

NOTE: compute-sanitizer's racecheck reports hazards in this kernel, all inside the code Triton
generates for `gl.warp_specialize` (captured values and partition states handed over through
shared memory around named barrier 1), none on the buffers and mbarriers managed here; memcheck
is clean and every numeric test passes (bench/results/README.md, racecheck-sm90-*). The service
can turn this path off with ATTENTION_HOPPER_KERNEL=false.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.launch import Relauncher

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton: the plain kernel serves every batch
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "SM90_CONFIG", "Sm90Config", "extend_attention_sm90", "prepare_sm90",
           "supported"]

BLOCK_M = 64  # query rows per consumer warpgroup (wgmma's M); a CTA owns 2 * BLOCK_M rows
CONSUMERS = 2
CONSUMER_REGS = 240  # per thread, after the producer gives its registers back


@dataclass(frozen=True)
class Sm90Config:
    """block_n: keys per K/V stage; stages: ring depth (3 x 128 keys at D=128 is 192 KB of
    the 227 KB a CTA may hold, with 32 KB of Q); overlap: the in-warpgroup pipelining of
    `_overlapped` (needs >= 3 stages to keep the producer a stage ahead); heads_first: grid
    (H, q-blocks, B), all heads of the longest q-blocks first.

    A persistent variant (one CTA per SM walking the tiles heaviest-first, its producer
    streaming the next tile's K/V under the current one) measured no faster in a trial run on
    the H200 (593 vs 599 TFLOP/s at 16k, 462 vs 465 on the 64-prompt varlen batch), so it was
    not kept; nor was a compact tile list instead of the grid's empty CTAs (460 vs 464 varlen,
    bench/results/attention-s4-compact-tiles-*).

    pingpong: FA3's warp-scheduler ordering: a consumer waits for the other's turn before it
    issues its wgmmas and passes the turn right after, so one's softmax runs under the other's
    tensor-core work by schedule rather than by drift (needs overlap). Measured within the
    spread between repeats: varlen 461-470 vs 442-467 TFLOP/s, 4k 533 vs 530-556, 16k 562-605 vs
    567-600 (bench/results/attention-pingpong-s7-*), so it stays off."""

    block_n: int = 128
    stages: int = 3
    overlap: bool = True
    heads_first: bool = True
    pingpong: bool = False


# H200 (bench/results/attention-s4-h200-2026-11-29.md), causal D=128, 32q/8kv heads, TFLOP/s at
# 4k / 16k: this config 537 / 598; without overlap (2 stages) 509 / 548; grid (q-blocks, H, B)
# 524 / 614; 64-key stages 514 / 483; SDPA cuDNN 509 / 575. Varlen batch: 464 for the first two.
SM90_CONFIG = Sm90Config()


def supported(*xs: torch.Tensor) -> bool:
    """Whether this path can run these (T, heads, D) tensors: a Hopper GPU, 16-bit floats,
    D of 64 or 128, and what TMA needs (16-byte aligned bases and row strides, packed heads)."""
    q = xs[0]
    if not (HAS_GLUON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if q.shape[2] not in (64, 128) or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return all(x.dtype == q.dtype and x.data_ptr() % 16 == 0
               and x.stride(0) * x.element_size() % 16 == 0 and x.stride(2) == 1
               and x.stride(1) == x.shape[2] for x in xs)


if HAS_GLUON:

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
                  q_row, q_col, kv_row, kv_col, n_blocks,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
        for j in range(n_blocks):
            s = j % STAGES
            # a stage is free once both consumers arrived on it; a fresh barrier passes parity 1
            mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            ready = kv_ready.index(s)
            mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], ready,
                                            k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], ready,
                                            v_smem.index(s))

    @gluon.jit
    def _step(j, base, q, k_smem, v_smem, kv_ready, kv_empty, acc, l_i, m_i, rows, qk_scale,
              qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              MASK: gl.constexpr):
        """One K/V block: QK^T, the online softmax update, PV; then release the stage. The
        ring position is base + j (base: blocks this CTA consumed for earlier tiles)."""
        s = (base + j) % STAGES
        mbarrier.wait(kv_ready.index(s), ((base + j) // STAGES) & 1)
        qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, qk_layout)
        qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        if MASK:  # the diagonal: keys past a row are -inf (each row sees its own key)
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
            qk = gl.where(rows[:, None] >= keys[None, :], qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(s), count=1)
        return acc, l_i, m_new

    @gluon.jit
    def _scores(j, base, q, k_smem, kv_ready, qk_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Issue QK^T of block j (async) once its stage (ring position base + j) has landed."""
        s = (base + j) % STAGES
        mbarrier.wait(kv_ready.index(s), ((base + j) // STAGES) & 1)
        qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, qk_layout)
        return warpgroup_mma(q, k_smem.index(s).permute((1, 0)), qk, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _masked(qk, j, rows, n_full, qk_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        if j >= n_full:  # the diagonal: keys past a row are -inf
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
            qk = gl.where(rows[:, None] >= keys[None, :], qk, float("-inf"))
        return qk

    @gluon.jit
    def _turn_wait(turn, k, CID: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the other consumer has issued its k-th set of wgmmas (consumer
        0 goes first: a fresh barrier passes parity 1)."""
        if PINGPONG:
            mbarrier.wait(turn.index(CID), (k & 1) ^ (1 - CID))

    @gluon.jit
    def _turn_pass(turn, CID: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: this consumer's wgmmas are issued; the other may issue its own."""
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CID), count=1)

    @gluon.jit
    def _overlapped(base, q, k_smem, v_smem, kv_ready, kv_empty, turn, acc, l_i, m_i, rows,
                    qk_scale, n_full, n_blocks, qk_layout: gl.constexpr, p_layout: gl.constexpr,
                    row_o: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, CID: gl.constexpr, PINGPONG: gl.constexpr):
        """FlashAttention-3's in-warpgroup pipelining: QK^T of block j and PV of block j-1 are
        in flight together, and the softmax of block j runs while PV(j-1) is on the tensor
        cores; acc is rescaled only after PV(j-1) lands. Holds two stages at a time."""
        _turn_wait(turn, 0, CID, PINGPONG)
        qk = _scores(0, base, q, k_smem, kv_ready, qk_layout, BLOCK_M, BLOCK_N, STAGES)
        _turn_pass(turn, CID, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        qk = _masked(qk, 0, rows, n_full, qk_layout, BLOCK_N)
        m_i = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_i[:, None])
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        for j in range(1, n_blocks):
            sp = (base + j - 1) % STAGES
            _turn_wait(turn, j, CID, PINGPONG)
            qk = _scores(j, base, q, k_smem, kv_ready, qk_layout, BLOCK_M, BLOCK_N, STAGES)
            acc = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
            _turn_pass(turn, CID, PINGPONG)
            qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # QK^T(j) lands first
            qk = _masked(qk, j, rows, n_full, qk_layout, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
            p = gl.exp2(qk * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            m_i = m_new
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        last = (base + n_blocks - 1) % STAGES
        _turn_wait(turn, n_blocks, CID, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        _turn_pass(turn, CID, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(last), count=1)
        return acc, l_i

    @gluon.jit
    def _tile(o_ptr, stride_ot, q, k_smem, v_smem, kv_ready, kv_empty, turn, qk_scale,
              q_start, q_len, tile_row, o_col, n_blocks, base, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CID: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
        """One consumer's 64 rows of one tile: every K/V block up to the diagonal, then o."""
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_qk: gl.constexpr = gl.SliceLayout(1, qk_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        row0 = tile_row + CID * BLOCK_M  # this warpgroup's first row, within the sequence
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_qk)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_qk)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_qk)  # finite: no inf - inf
        n_full = (row0 + 1) // BLOCK_N  # blocks whose every key is at or before row0
        if OVERLAP:
            acc, l_i = _overlapped(base, q, k_smem, v_smem, kv_ready, kv_empty, turn, acc, l_i,
                                   m_i, rows, qk_scale, n_full, n_blocks, qk_layout, p_layout,
                                   row_o, BLOCK_M, BLOCK_N, STAGES, CID, PINGPONG)
        else:
            for j in range(0, n_full):
                acc, l_i, m_i = _step(j, base, q, k_smem, v_smem, kv_ready, kv_empty, acc, l_i,
                                      m_i, rows, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                      BLOCK_N, STAGES, False)
            for j in range(n_full, n_blocks):
                acc, l_i, m_i = _step(j, base, q, k_smem, v_smem, kv_ready, kv_empty, acc, l_i,
                                      m_i, rows, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                      BLOCK_N, STAGES, True)
        acc = acc / gl.convert_layout(l_i, row_o)[:, None]
        r = row0 + gl.arange(0, BLOCK_M, layout=row_o)
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = o_ptr + (q_start + r).to(gl.int64)[:, None] * stride_ot + o_col + d[None, :]
        gl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=(r < q_len)[:, None])

    @gluon.jit
    def _consumer(o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
                  qk_scale, q_start, q_len, tile_row, o_col, n_blocks,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CID: gl.constexpr, OVERLAP: gl.constexpr,
                  PINGPONG: gl.constexpr):
        mbarrier.wait(q_bar, 0)
        _tile(o_ptr, stride_ot, q_smem.slice(CID * BLOCK_M, BLOCK_M), k_smem, v_smem, kv_ready,
              kv_empty, turn, qk_scale, q_start, q_len, tile_row, o_col, n_blocks, 0, HEAD_DIM,
              BLOCK_M, BLOCK_N, STAGES, CID, OVERLAP, PINGPONG)


    @gluon.jit
    def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, cu_seqlens_q_ptr, qk_scale, kv_group,
                          stride_ot, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          HEADS_FIRST: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
        if HEADS_FIRST:
            h = gl.program_id(0)
            pid_m = gl.program_id(1)
        else:
            pid_m = gl.program_id(0)
            h = gl.program_id(1)
        b = gl.program_id(2)
        TILE: gl.constexpr = 2 * BLOCK_M
        q_start = gl.load(cu_seqlens_q_ptr + b)
        q_len = gl.load(cu_seqlens_q_ptr + b + 1) - q_start
        m_block = gl.cdiv(q_len, TILE) - 1 - pid_m  # longest-work-first within the sequence
        if m_block >= 0:
            tile_row = m_block * TILE
            n_blocks = gl.cdiv(gl.minimum(tile_row + TILE, q_len), BLOCK_N)
            dtype: gl.constexpr = q_desc.dtype
            q_smem = gl.allocate_shared_memory(dtype, [TILE, HEAD_DIM], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(kv_ready.index(i), count=1)
                mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
            o_col = h * HEAD_DIM
            gl.warp_specialize(
                [(_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready,
                              kv_empty, q_start + tile_row, o_col, q_start,
                              (h // kv_group) * HEAD_DIM, n_blocks, BLOCK_N, STAGES)),
                 (_consumer, (o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready,
                              kv_empty, turn, qk_scale, q_start, q_len, tile_row, o_col,
                              n_blocks, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 0, OVERLAP,
                              PINGPONG)),
                 (_consumer, (o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready,
                              kv_empty, turn, qk_scale, q_start, q_len, tile_row, o_col,
                              n_blocks, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 1, OVERLAP,
                              PINGPONG))],
                [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def _descriptor(x: torch.Tensor, rows: int):
    """x (T, heads, D) with packed heads as a 2-D (T, heads * D) TMA descriptor, [rows, D]."""
    T, heads, D = x.shape
    layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16 if x.dtype ==
                                                  torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, [T, heads * D], [x.stride(0), 1], [rows, D], layout)


def prepare_sm90(q, k, v, cu_seqlens_q, max_q_len, sm_scale=None, out=None,
                 config: Sm90Config = SM90_CONFIG, *, num_tokens: int | None = None
                 ) -> tuple[Relauncher | None, torch.Tensor]:
    """Check and bind one launch: (launcher, o); `launcher(o)` runs it writing into o (or
    another tensor of o's shape, strides and alignment); None when there is nothing to compute.

    q (T, H, D), k/v (T, KVH, D) (see `supported`), cu_seqlens_q (B + 1,) int32, max_q_len >=
    the longest sequence. `num_tokens` = cu_seqlens_q[-1] if the caller knows it: TMA then
    reads rows below it only (zeros beyond), so padding rows past the last sequence are never
    read. Without it all T rows may be read as keys (masked out, but a NaN there would leak
    through P @ V), so they must be finite. Output rows past each sequence are never written."""
    T, H, D = q.shape
    KVH = k.shape[1]
    B = cu_seqlens_q.shape[0] - 1
    assert H % KVH == 0 and k.shape == v.shape == (T, KVH, D), "q/k/v shapes"
    assert cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must be int32"
    assert cu_seqlens_q.device == q.device, "cu_seqlens_q on another device"
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    assert out.shape == (T, H, D) and out.dtype == q.dtype, "out must be (T, H, D) in q's dtype"
    assert out.stride(2) == 1 and out.stride(1) == D, "out: heads must be packed, contiguous"
    assert supported(q, k, v), "extend_attention_sm90: unsupported inputs (see supported())"
    if B == 0 or max_q_len <= 0 or T == 0 or num_tokens == 0:
        return None, out
    if num_tokens is not None:
        assert 0 < num_tokens <= T, f"num_tokens {num_tokens} outside (0, {T}]"
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
    c = config
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    n_m = -(-max_q_len // (CONSUMERS * BLOCK_M))
    args = (_descriptor(q, CONSUMERS * BLOCK_M), _descriptor(k, c.block_n),
            _descriptor(v, c.block_n), out, cu_seqlens_q, scale / math.log(2.0), H // KVH,
            out.stride(0))
    meta = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=c.block_n, STAGES=c.stages,
                CONSUMER_REGS=CONSUMER_REGS, OVERLAP=c.overlap,
                PINGPONG=c.overlap and c.pingpong, num_warps=4)
    grid = (H, n_m, B) if c.heads_first else (n_m, H, B)
    return Relauncher(_attention_kernel, grid, args, dict(meta, HEADS_FIRST=c.heads_first),
                      (3,)), out



def extend_attention_sm90(q, k, v, cu_seqlens_q, max_q_len, sm_scale=None, out=None,
                          config: Sm90Config = SM90_CONFIG, *,
                          num_tokens: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens to themselves (no prefix), on sm_90;
    returns o (T, H, D). See `prepare_sm90`."""
    launch, out = prepare_sm90(q, k, v, cu_seqlens_q, max_q_len, sm_scale, out, config,
                               num_tokens=num_tokens)
    if launch is not None:
        launch(out)
    return out
