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
(`_pipeline`, FA3's in-warpgroup pipelining). H200, causal, D=128, 32q/8kv heads, TFLOP/s at
S = 4k / 8k / 16k: 560 / 592 / 603 against 496 / 537 / 562 for SDPA's cuDNN backend in the same
run; the 64-prompt varlen batch 486 against 404 for cuDNN's per-prompt loop
(bench/results/attention-s8-h200-2026-12-01.md).

Causal work skipped: a CTA's 128 rows meet 128-key blocks, so each tile has exactly one
diagonal block. It goes first (online softmax is order-free), which makes it the only masked
block; consumer 0, whose 64 rows end halfway into it, computes only its first 64 keys; and a
consumer whose rows all lie past the sequence's end (the top tile of a sequence with <= 64 rows
in it) issues no wgmma at all. On the 64-prompt varlen batch of bench/attention.py that cuts
the tensor-core work from 1.093x to 1.045x the causal FLOPs counted; measured against the
previous schedule on the same inputs: varlen 484-488 vs 436-441 TFLOP/s, 4k / 8k / 16k 545 /
573 / 587 vs 527 / 557 / 570 (bench/results/attention-diagfirst-ab-s8-*).

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
    """stages: depth of the K/V ring (3 x 128 keys at D=128 is 192 KB of the 227 KB a CTA may
    hold, with 32 KB of Q; the in-warpgroup pipelining of `_consume` holds two stages at a time
    and needs a third to keep the producer a stage ahead); heads_first: grid (H, q-blocks, B),
    all heads of the longest q-blocks first, else (q-blocks, H, B).

    A persistent variant (one CTA per SM walking the tiles heaviest-first, its producer
    streaming the next tile's K/V under the current one) measured no faster in a trial run on
    the H200 (593 vs 599 TFLOP/s at 16k, 462 vs 465 on the 64-prompt varlen batch), so it was
    not kept; nor was a compact tile list instead of the grid's empty CTAs (460 vs 464 varlen,
    bench/results/attention-s4-compact-tiles-*), nor 64-key stages (514 vs 537 at 4k, 417 vs
    464 varlen) or a schedule without the in-warpgroup pipelining (509 vs 537, 430 vs 464:
    bench/results/attention-s4-*).

    pingpong: FA3's warp-scheduler ordering: a consumer waits for the other's turn before it
    issues its wgmmas and passes the turn right after, so one's softmax runs under the other's
    tensor-core work by schedule rather than by drift. With the diagonal-first schedule it
    costs: varlen 467-470 vs 484-488 TFLOP/s without, 4k 532-539 vs 544-545
    (bench/results/attention-diagfirst-ab-s8-*; before it, within the spread between repeats:
    attention-pingpong-s7-*), so it stays off. Grid (q-blocks, H, B) measured 610-612 vs 586-587
    at 16k but 469-474 vs 484-488 varlen and 508-515 vs 544-545 at 4k."""

    stages: int = 3
    heads_first: bool = True
    pingpong: bool = False


# H200 (bench/results/attention-s8-h200-2026-12-01.md), causal D=128, 32q/8kv heads, TFLOP/s at
# 4k / 16k: this config 560 / 603, SDPA cuDNN 496 / 562; varlen batch 486 (grid (q-blocks, H, B)
# 488 in that run, 469-474 vs 484-488 in the interleaved A/B), cuDNN's per-prompt loop 404.
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
        """Q once, then K/V in the consumers' order: the diagonal block first, then blocks
        0 .. n-2 (ring position p holds key block (p + n - 1) % n)."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
        for p in range(n_blocks):
            s = p % STAGES
            # a stage is free once both consumers arrived on it; a fresh barrier passes parity 1
            mbarrier.wait(kv_empty.index(s), ((p // STAGES) & 1) ^ 1)
            ready = kv_ready.index(s)
            row = kv_row + ((p + n_blocks - 1) % n_blocks) * BLOCK_N
            mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], ready, k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], ready, v_smem.index(s))

    @gluon.jit
    def _scores(p, q, k_smem, kv_ready, qk_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Issue QK^T (async) of ring position p once its stage has landed."""
        s = p % STAGES
        mbarrier.wait(kv_ready.index(s), (p // STAGES) & 1)
        qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, qk_layout)
        return warpgroup_mma(q, k_smem.index(s).permute((1, 0)), qk, use_acc=False,
                             is_async=True)

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
    def _consume(q, k_smem, v_smem, kv_ready, kv_empty, turn, qk_scale, row0, diag0, n_blocks,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIAG_N: gl.constexpr, STAGES: gl.constexpr, CID: gl.constexpr,
                 PINGPONG: gl.constexpr):
        """One consumer's 64 rows of one tile: (acc, l) over every key up to the diagonal.

        The diagonal block comes first (ring position 0; online softmax does not care about
        the order), so it is the only masked one, and only its first DIAG_N keys are computed:
        consumer 0's rows end 64 keys into it, the rest is masked for all of them. Then key
        blocks 0 .. n-2, unmasked, with FlashAttention-3's in-warpgroup pipelining: QK^T of one
        block and PV of the previous are in flight together and the softmax runs while PV is
        on the tensor cores; acc is rescaled only after that PV lands. Holds two stages at a
        time. Issues n + 1 sets of wgmmas (the ping-pong turns), whatever n is."""
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        qkd_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DIAG_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_qk: gl.constexpr = gl.SliceLayout(1, qk_layout)
        row_qkd: gl.constexpr = gl.SliceLayout(1, qkd_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        # ring position 0: the diagonal block, its first DIAG_N keys
        _turn_wait(turn, 0, CID, PINGPONG)
        mbarrier.wait(kv_ready.index(0), 0)
        s_d = gl.zeros([BLOCK_M, DIAG_N], gl.float32, qkd_layout)
        s_d = warpgroup_mma(q, k_smem.index(0).slice(0, DIAG_N).permute((1, 0)), s_d,
                            use_acc=False, is_async=True)
        _turn_pass(turn, CID, PINGPONG)
        s_d = warpgroup_mma_wait(num_outstanding=0, deps=(s_d,))
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_qkd)
        keys = diag0 + gl.arange(0, DIAG_N, layout=gl.SliceLayout(0, qkd_layout))
        s_d = gl.where(rows[:, None] >= keys[None, :], s_d, float("-inf"))
        m_d = gl.max(s_d, axis=1) * qk_scale  # finite: every row sees its own key
        e_d = gl.exp2(s_d * qk_scale - m_d[:, None])
        l_i = gl.convert_layout(gl.sum(e_d, axis=1), row_qk)
        m_i = gl.convert_layout(m_d, row_qk)
        p_d = gl.convert_layout(e_d.to(v_smem.dtype), p_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if DIAG_N == BLOCK_N:  # consumer 1: the diagonal's P has the loop's shape
            acc, l_i = _pipeline(1, n_blocks, q, k_smem, v_smem, kv_ready, kv_empty, turn, p_d,
                                 acc, m_i, l_i, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                 BLOCK_N, STAGES, CID, PINGPONG)
        elif n_blocks > 1:  # consumer 0: position 1 peeled, with the half-width PV in flight
            acc, m_i, l_i, p_op = _advance(1, q, k_smem, v_smem.index(0).slice(0, DIAG_N),
                                           kv_ready, kv_empty, turn, p_d, acc, m_i, l_i, qk_scale,
                                           qk_layout, p_layout, row_o, BLOCK_M, BLOCK_N, STAGES,
                                           CID, PINGPONG)
            acc, l_i = _pipeline(2, n_blocks, q, k_smem, v_smem, kv_ready, kv_empty, turn, p_op,
                                 acc, m_i, l_i, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                 BLOCK_N, STAGES, CID, PINGPONG)
        else:  # consumer 0 of a sequence's first tile: the half diagonal is all there is
            _turn_wait(turn, 1, CID, PINGPONG)
            acc = warpgroup_mma(p_d, v_smem.index(0).slice(0, DIAG_N), acc, is_async=True)
            _turn_pass(turn, CID, PINGPONG)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(0), count=1)
        return acc, l_i

    @gluon.jit
    def _advance(j, q, k_smem, v_prev, kv_ready, kv_empty, turn, p_prev, acc, m_i, l_i, qk_scale,
                 qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CID: gl.constexpr, PINGPONG: gl.constexpr):
        """One pipelined step: QK^T of ring position j issued with PV of position j - 1 (P
        p_prev, V v_prev: the diagonal's may be half width), the softmax of j under that PV,
        then position j - 1 released. Returns (acc, m, l, P of j)."""
        _turn_wait(turn, j, CID, PINGPONG)
        qk = _scores(j, q, k_smem, kv_ready, qk_layout, BLOCK_M, BLOCK_N, STAGES)
        acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
        _turn_pass(turn, CID, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # QK^T(j) lands first
        m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        return acc, m_new, l_i, gl.convert_layout(p.to(v_prev.dtype), p_layout)

    @gluon.jit
    def _pipeline(j0, n_blocks, q, k_smem, v_smem, kv_ready, kv_empty, turn, p_op, acc, m_i, l_i,
                  qk_scale, qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CID: gl.constexpr, PINGPONG: gl.constexpr):
        """Ring positions j0 .. n-1 (unmasked), p_op holding position j0 - 1's P whose PV has
        not been issued yet; then that last PV. Issues n - j0 + 1 sets of wgmmas."""
        for j in range(j0, n_blocks):
            acc, m_i, l_i, p_op = _advance(j, q, k_smem, v_smem.index((j - 1) % STAGES),
                                           kv_ready, kv_empty, turn, p_op, acc, m_i, l_i,
                                           qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                           BLOCK_N, STAGES, CID, PINGPONG)
        last = (n_blocks - 1) % STAGES
        _turn_wait(turn, n_blocks, CID, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        _turn_pass(turn, CID, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(last), count=1)
        return acc, l_i

    @gluon.jit
    def _idle(kv_ready, kv_empty, turn, n_blocks, STAGES: gl.constexpr, CID: gl.constexpr,
              PINGPONG: gl.constexpr):
        """A consumer whose rows all lie past the sequence's end (the top tile of a sequence
        with at most 64 rows in it): no wgmmas, but it releases every stage once it has landed
        (releasing earlier could complete a later phase of the stage's barrier) and keeps the
        ping-pong turns going."""
        for p in range(n_blocks):
            _turn_wait(turn, p, CID, PINGPONG)
            _turn_pass(turn, CID, PINGPONG)
            mbarrier.wait(kv_ready.index(p % STAGES), (p // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(p % STAGES), count=1)
        _turn_wait(turn, n_blocks, CID, PINGPONG)
        _turn_pass(turn, CID, PINGPONG)

    @gluon.jit
    def _consumer(o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
                  qk_scale, q_start, q_len, tile_row, o_col, n_blocks,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CID: gl.constexpr, PINGPONG: gl.constexpr):
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row0 = tile_row + CID * BLOCK_M  # this warpgroup's first row, within the sequence
        if row0 < q_len:  # always for consumer 0
            mbarrier.wait(q_bar, 0)
            # consumer 0's rows end halfway into the diagonal block: it computes half of it
            acc, l_i = _consume(q_smem.slice(CID * BLOCK_M, BLOCK_M), k_smem, v_smem, kv_ready,
                                kv_empty, turn, qk_scale, row0, tile_row, n_blocks, HEAD_DIM,
                                BLOCK_M, BLOCK_N, (CID + 1) * BLOCK_M, STAGES, CID, PINGPONG)
            acc = acc / gl.convert_layout(l_i, row_o)[:, None]
            r = row0 + gl.arange(0, BLOCK_M, layout=row_o)
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = o_ptr + (q_start + r).to(gl.int64)[:, None] * stride_ot + o_col + d[None, :]
            gl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=(r < q_len)[:, None])
        else:
            _idle(kv_ready, kv_empty, turn, n_blocks, STAGES, CID, PINGPONG)

    @gluon.jit
    def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, cu_seqlens_q_ptr, qk_scale, kv_group,
                          stride_ot, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          STAGES: gl.constexpr, HEADS_FIRST: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr):
        if HEADS_FIRST:
            h = gl.program_id(0)
            pid_m = gl.program_id(1)
        else:
            pid_m = gl.program_id(0)
            h = gl.program_id(1)
        b = gl.program_id(2)
        TILE: gl.constexpr = 2 * BLOCK_M  # rows per CTA = keys per K/V block
        q_start = gl.load(cu_seqlens_q_ptr + b)
        q_len = gl.load(cu_seqlens_q_ptr + b + 1) - q_start
        m_block = gl.cdiv(q_len, TILE) - 1 - pid_m  # longest-work-first within the sequence
        if m_block >= 0:
            tile_row = m_block * TILE
            n_blocks = m_block + 1  # key blocks up to and including the diagonal
            dtype: gl.constexpr = q_desc.dtype
            q_smem = gl.allocate_shared_memory(dtype, [TILE, HEAD_DIM], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], v_desc.layout)
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
                              (h // kv_group) * HEAD_DIM, n_blocks, TILE, STAGES)),
                 (_consumer, (o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready,
                              kv_empty, turn, qk_scale, q_start, q_len, tile_row, o_col,
                              n_blocks, HEAD_DIM, BLOCK_M, TILE, STAGES, 0, PINGPONG)),
                 (_consumer, (o_ptr, stride_ot, q_smem, k_smem, v_smem, q_bar, kv_ready,
                              kv_empty, turn, qk_scale, q_start, q_len, tile_row, o_col,
                              n_blocks, HEAD_DIM, BLOCK_M, TILE, STAGES, 1, PINGPONG))],
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
    tile = CONSUMERS * BLOCK_M  # query rows per CTA = keys per K/V block
    n_m = -(-max_q_len // tile)
    args = (_descriptor(q, tile), _descriptor(k, tile), _descriptor(v, tile), out, cu_seqlens_q,
            scale / math.log(2.0), H // KVH, out.stride(0))
    meta = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=c.stages, CONSUMER_REGS=CONSUMER_REGS,
                PINGPONG=c.pingpong, num_warps=4)
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
