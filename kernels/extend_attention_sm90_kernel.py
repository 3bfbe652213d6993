"""Hopper extend attention in Gluon, FlashAttention-3's schedule: a producer warpgroup streams K/V
through a TMA/mbarrier ring, two 64-row consumers softmax under each other's wgmmas."""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton: the plain kernel serves every batch
    HAS_GLUON = False

BLOCK_M = 64  # query rows per consumer warpgroup (wgmma's M); a CTA owns 2 * BLOCK_M rows
CONSUMERS = 2
CONSUMER_REGS = 240  # per thread, after the producer gives its registers back


if HAS_GLUON:

    @gluon.jit
    def _tile(t, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span, ORDER: gl.constexpr,
              TILE: gl.constexpr):
        """(head, seq start, length, q-block from the end; < 0: past it) of tile t; ORDER 2 gives
        each round of looping CTAs one depth, so no CTA collects the long tiles."""
        if ORDER == 0:
            h = t % n_heads
            pid_m = (t // n_heads) % n_m
            b = t // span
        elif ORDER == 1:
            pid_m = t % n_m
            h = (t // n_m) % n_heads
            b = t // span
        else:
            h = t % n_heads
            b = (t // n_heads) % n_seqs
            pid_m = t // span
        q_start = gl.load(cu_seqlens_q_ptr + b)
        q_len = gl.load(cu_seqlens_q_ptr + b + 1) - q_start
        return h, q_start, q_len, gl.cdiv(q_len, TILE) - 1 - pid_m

    @gluon.jit
    def _tiles():
        """(first tile, stride), read where used by non-pure asm: a value kept across the partition
        split may live on the stack, out of a partition's local memory range (an H200 faults)."""
        first = gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1)
        step = gl.inline_asm_elementwise("mov.u32 $0, %nctaid.x;", "=r", [], dtype=gl.int32,
                                         is_pure=False, pack=1)
        return first, step

    @gluon.jit
    def _store_kv(k_rows, v_rows, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kcs, stride_vcs,
                  row, n_rows, kv_col, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  layout: gl.constexpr):
        """Rows row .. row + n_rows - 1 of a K/V stage into the cache at their slots."""
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        live = r < n_rows
        slot = gl.load(slot_ptr + row + r, mask=live, other=0).to(gl.int64)
        mask = live[:, None]
        gl.store(k_cache_ptr + slot[:, None] * stride_kcs + kv_col + d[None, :],
                 k_rows.load(layout), mask=mask)
        gl.store(v_cache_ptr + slot[:, None] * stride_vcs + kv_col + d[None, :],
                 v_rows.load(layout), mask=mask)

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, g, row, kv_col,
                 STAGES: gl.constexpr):
        """K/V rows from `row` into ring slot g's stage once free (fresh barriers pass parity 1)."""
        s = g % STAGES
        mbarrier.wait(kv_empty.index(s), ((g // STAGES) & 1) ^ 1)
        ready = kv_ready.index(s)
        mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], ready, k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], ready, v_smem.index(s))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready,
                  kv_empty, kv_group, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span, n_tiles,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  ORDER: gl.constexpr, Q_SLOTS: gl.constexpr):
        """Per tile: the diagonal K/V block, Q once its slot is free, then blocks 0 .. n-2."""
        i = 0
        base = 0
        first, step = _tiles()
        for t in range(first, n_tiles, step):
            h, q_start, q_len, m_block = _tile(t, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span,
                                               ORDER, BLOCK_N)
            if m_block >= 0:
                kv_col = (h // kv_group) * HEAD_DIM
                _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, base,
                         q_start + m_block * BLOCK_N, kv_col, STAGES)
                slot = i % Q_SLOTS
                mbarrier.wait(q_empty.index(slot), ((i // Q_SLOTS) & 1) ^ 1)
                mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_start + m_block * BLOCK_N,
                                                         h * HEAD_DIM], q_bar.index(slot),
                                                q_smem.index(slot))
                for p in range(1, m_block + 1):
                    _load_kv(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, base + p,
                             q_start + (p - 1) * BLOCK_N, kv_col, STAGES)
                i += 1
                base += m_block + 1

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
    def _consume(q, k_smem, v_smem, kv_ready, kv_empty, qk_scale, row0, diag0, n_blocks, base,
                 k_cache_ptr, v_cache_ptr, slot_ptr, stride_kcs, stride_vcs, token0, n_store,
                 kv_col, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIAG_N: gl.constexpr, STAGES: gl.constexpr, STORE_KV: gl.constexpr,
                 store_layout: gl.constexpr):
        """(acc, l) of a consumer's rows; STORE_KV writes its rows of the diagonal K/V meanwhile."""
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

        s0 = base % STAGES
        mbarrier.wait(kv_ready.index(s0), (base // STAGES) & 1)
        s_d = gl.zeros([BLOCK_M, DIAG_N], gl.float32, qkd_layout)
        s_d = warpgroup_mma(q, k_smem.index(s0).slice(0, DIAG_N).permute((1, 0)), s_d,
                            use_acc=False, is_async=True)
        if STORE_KV:
            if n_store > 0:
                _store_kv(k_smem.index(s0).slice(DIAG_N - BLOCK_M, BLOCK_M),
                          v_smem.index(s0).slice(DIAG_N - BLOCK_M, BLOCK_M), k_cache_ptr,
                          v_cache_ptr, slot_ptr, stride_kcs, stride_vcs, token0, n_store, kv_col,
                          HEAD_DIM, BLOCK_M, store_layout)
        s_d = warpgroup_mma_wait(num_outstanding=0, deps=(s_d,))
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_qkd)
        keys = diag0 + gl.arange(0, DIAG_N, layout=gl.SliceLayout(0, qkd_layout))
        s_d = gl.where(rows[:, None] >= keys[None, :], s_d * qk_scale, float("-inf"))
        m_d = gl.max(s_d, axis=1)  # finite: every row sees its own key
        e_d = gl.exp2(s_d - m_d[:, None])
        l_i = gl.convert_layout(gl.sum(e_d, axis=1), row_qk)
        m_i = gl.convert_layout(m_d, row_qk)
        p_d = gl.convert_layout(e_d.to(v_smem.dtype), p_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if DIAG_N == BLOCK_N:  # consumer 1: the diagonal's P has the loop's shape
            acc, l_i = _pipeline(1, n_blocks, base, q, k_smem, v_smem, kv_ready, kv_empty, p_d,
                                 acc, m_i, l_i, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                 BLOCK_N, STAGES)
        elif n_blocks > 1:  # consumer 0: position 1 peeled, with the half-width PV in flight
            acc, m_i, l_i, p_op = _advance(base + 1, q, k_smem, v_smem.index(s0).slice(0, DIAG_N),
                                           kv_ready, kv_empty, p_d, acc, m_i, l_i, qk_scale,
                                           qk_layout, p_layout, row_o, BLOCK_M, BLOCK_N, STAGES)
            acc, l_i = _pipeline(2, n_blocks, base, q, k_smem, v_smem, kv_ready, kv_empty, p_op,
                                 acc, m_i, l_i, qk_scale, qk_layout, p_layout, row_o, BLOCK_M,
                                 BLOCK_N, STAGES)
        else:  # consumer 0 of a sequence's first tile: the half diagonal is all there is
            acc = warpgroup_mma(p_d, v_smem.index(s0).slice(0, DIAG_N), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(s0), count=1)
        return acc, l_i

    @gluon.jit
    def _advance(j, q, k_smem, v_prev, kv_ready, kv_empty, p_prev, acc, m_i, l_i, qk_scale,
                 qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """QK^T(j) while PV(j-1) runs, softmax(j) under it, release j-1: (acc, m, l, P_j)."""
        qk = _scores(j, q, k_smem, kv_ready, qk_layout, BLOCK_M, BLOCK_N, STAGES)
        acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
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
    def _pipeline(j0, n_blocks, base, q, k_smem, v_smem, kv_ready, kv_empty, p_op, acc, m_i,
                  l_i, qk_scale, qk_layout: gl.constexpr, p_layout: gl.constexpr,
                  row_o: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
        """Blocks j0 .. n-1, p_op holding block j0 - 1's P (its PV not issued); then the last PV."""
        for j in range(base + j0, base + n_blocks):
            acc, m_i, l_i, p_op = _advance(j, q, k_smem, v_smem.index((j - 1) % STAGES),
                                           kv_ready, kv_empty, p_op, acc, m_i, l_i, qk_scale,
                                           qk_layout, p_layout, row_o, BLOCK_M, BLOCK_N, STAGES)
        last = (base + n_blocks - 1) % STAGES
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(last), count=1)
        return acc, l_i

    @gluon.jit
    def _idle(kv_ready, kv_empty, n_blocks, base, STAGES: gl.constexpr):
        """Rows past the sequence: release each stage once landed (earlier: a later phase)."""
        for p in range(base, base + n_blocks):
            mbarrier.wait(kv_ready.index(p % STAGES), (p // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(p % STAGES), count=1)

    @gluon.jit
    def _consumer(o_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_ot, stride_kcs, stride_vcs,
                  q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, qk_scale, kv_group,
                  cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span, n_tiles, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  ORDER: gl.constexpr, Q_SLOTS: gl.constexpr, STORE_KV: gl.constexpr,
                  CID: gl.constexpr):
        """Rows CID * BLOCK_M .. of each tile; an idle consumer waits for Q too before releasing it,
        else it could run Q_SLOTS tiles ahead and free a Q in use."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # 8 contiguous elements (16 bytes) a thread, a row across HEAD_DIM // 8 threads
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8],
                                                    [4, 1], [1, 0])
        i = 0
        base = 0
        first, step = _tiles()
        for t in range(first, n_tiles, step):
            h, q_start, q_len, m_block = _tile(t, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span,
                                               ORDER, BLOCK_N)
            if m_block >= 0:
                tile_row = m_block * BLOCK_N
                row0 = tile_row + CID * BLOCK_M
                slot = i % Q_SLOTS
                mbarrier.wait(q_bar.index(slot), (i // Q_SLOTS) & 1)
                if row0 < q_len:
                    # consumer 0's rows end halfway into the diagonal block: it computes half
                    q_rows = q_smem.index(slot).slice(CID * BLOCK_M, BLOCK_M)
                    n_store = gl.where(h % kv_group == 0, q_len - row0, 0)
                    acc, l_i = _consume(q_rows, k_smem, v_smem, kv_ready, kv_empty, qk_scale,
                                        row0, tile_row, m_block + 1, base, k_cache_ptr,
                                        v_cache_ptr, slot_ptr, stride_kcs, stride_vcs,
                                        q_start + row0, n_store, (h // kv_group) * HEAD_DIM,
                                        HEAD_DIM, BLOCK_M, BLOCK_N, (CID + 1) * BLOCK_M, STAGES,
                                        STORE_KV, out_layout)
                    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
                    # O via its dead Q rows in smem, then 16 bytes a thread: from the wgmma
                    # layout (4 bytes a row per thread) it would write every L2 sector twice
                    q_rows.store(acc.to(o_ptr.dtype.element_ty))
                    gl.thread_barrier()
                    o = q_rows.load(out_layout)
                    gl.thread_barrier()
                    fence_async_shared()  # before the next Q's TMA writes these rows
                    mbarrier.arrive(q_empty.index(slot), count=1)  # the slot may take the next Q
                    r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
                    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
                    ptrs = (o_ptr + (q_start + r).to(gl.int64)[:, None] * stride_ot
                            + h * HEAD_DIM + d[None, :])
                    gl.store(ptrs, o, mask=(r < q_len)[:, None])
                else:
                    _idle(kv_ready, kv_empty, m_block + 1, base, STAGES)
                    mbarrier.arrive(q_empty.index(slot), count=1)
                i += 1
                base += m_block + 1

    # No count specialized, one binary per launch shape: the GPU tests cover every binary, and
    # ptxas miscompiled some specializations (stack values; wgmma descriptors from another branch)
    @gluon.jit(do_not_specialize=["kv_group", "n_heads", "n_m", "n_seqs", "span", "n_tiles"])
    def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          cu_seqlens_q_ptr, qk_scale, kv_group, stride_ot, stride_kcs, stride_vcs,
                          n_heads, n_m, n_seqs, span, n_tiles, HEAD_DIM: gl.constexpr,
                          BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                          Q_SLOTS: gl.constexpr, STORE_KV: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr):
        TILE: gl.constexpr = 2 * BLOCK_M  # rows per tile = keys per K/V block
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [Q_SLOTS, TILE, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_SLOTS):
            mbarrier.init(q_bar.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers are done with this Q
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
        gl.warp_specialize(  # racecheck flags hazards only in here; memcheck is clean
            [(_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                          kv_ready, kv_empty, kv_group, cu_seqlens_q_ptr, n_heads, n_m, n_seqs,
                          span, n_tiles, HEAD_DIM, TILE, STAGES, ORDER, Q_SLOTS)),
             (_consumer, (o_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_ot, stride_kcs,
                          stride_vcs, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                          qk_scale, kv_group, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span, n_tiles,
                          HEAD_DIM, BLOCK_M, TILE, STAGES, ORDER, Q_SLOTS, STORE_KV, 0)),
             (_consumer, (o_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_ot, stride_kcs,
                          stride_vcs, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                          qk_scale, kv_group, cu_seqlens_q_ptr, n_heads, n_m, n_seqs, span, n_tiles,
                          HEAD_DIM, BLOCK_M, TILE, STAGES, ORDER, Q_SLOTS, STORE_KV, 1))],
            [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
