"""Extend attention's Triton kernel: FlashAttention-2 forward, exp2 softmax, fp32 acc, D <= 256.
PACK > 1: a program's rows hold a KV head's PACK query heads, so K/V loads once per group.
SLIDING: query i sees keys in (i - window, i]; only blocks below the edge pay for the mask."""

from __future__ import annotations

from kernels._triton import dot, tl, triton


@triton.jit
def _load(ptrs, mask, USE_MASK: tl.constexpr):
    if USE_MASK:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _softmax_step(
    acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr
):
    """One online-softmax update; masked scores must already be -inf (qk_scale > 0)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = dot(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _in_window(qk, q_pos, start_n, offs_n, edge, window, SLIDING: tl.constexpr):
    """Scores of keys at or before q_pos - window to -inf; blocks from `edge` on skip the mask."""
    if SLIDING:
        if start_n < edge:
            k_pos = start_n + offs_n
            qk = tl.where(k_pos[None, :] > q_pos[:, None] - window, qk, float("-inf"))
    return qk


# stride_ptb changes per batch, window per layer: specialized, they would compile new variants
@triton.jit(do_not_specialize=["stride_ptb", "window"])
def _extend_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    k_desc,
    v_desc,
    cu_seqlens_q_ptr,
    prefix_lens_ptr,
    page_table_ptr,
    slot_ptr,
    qk_scale,
    kv_group,
    window,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_kcs,
    stride_vcs,
    stride_ot,
    stride_ptb,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    STORE_KV: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    CACHE_TABLE: tl.constexpr,
    PACK: tl.constexpr,
    ROWS: tl.constexpr,  # positions a program owns: BLOCK_M, or packed BLOCK_M // PACK or less
    SLIDING: tl.constexpr,
):
    # h: the query head, or with PACK > 1 the KV head
    if HEADS_FIRST:  # grid (H, n_m, B): all heads of the longest q-blocks launch first
        h = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:  # grid (n_m, H, B): one head's q-blocks share its K/V in L2
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    m_block = tl.cdiv(q_len, ROWS) - 1 - pid_m  # longest-work-first within the sequence
    if m_block < 0:
        return
    prefix_len = tl.load(prefix_lens_ptr + b)
    if CACHE_TABLE:  # the caches' addresses are data: a captured graph reads them at replay
        # a loaded address has no known alignment; without multiple_of the loads go scalar
        elt = tl.pointer_type(q_ptr.dtype.element_ty)
        k_cache_ptr = tl.multiple_of(tl.load(k_cache_ptr).to(elt), 16)
        v_cache_ptr = tl.multiple_of(tl.load(v_cache_ptr).to(elt), 16)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD

    if PACK > 1:
        kvh = h
        stores_kv = h >= 0  # every program: its rows of its KV head
        tile = tl.arange(0, BLOCK_M)
        offs_m = m_block * ROWS + tile // PACK  # positions, each PACK times
        m_mask = (offs_m < q_len) & (tile < ROWS * PACK)
        cols = ((h * PACK + tile % PACK) * HEAD_DIM)[:, None]  # each row's head
    else:
        kvh = h // kv_group
        stores_kv = h % kv_group == 0  # the group's first head
        offs_m = m_block * ROWS + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        cols = h * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + cols + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked row stays NaN-free

    # (a) the cached prefix (compiled out for prefix-free batches: its addresses cost registers)
    kc_base = k_cache_ptr + kvh * HEAD_DIM  # also the fused KV store's target
    vc_base = v_cache_ptr + kvh * HEAD_DIM
    diag_start = m_block * ROWS
    # SLIDING: the highest row's first key in its window; every row sees every key from here on
    new_edge = diag_start + ROWS - window  # a new-token position (prefix_len + it: absolute)
    if HAS_PREFIX:
        pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
        prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
        q_pos = prefix_len + offs_m  # absolute positions: the prefix counts first
        prefix_start = 0
        tail_start = prefix_full
        if SLIDING:  # from the block of the lowest row's first key in its window
            prefix_start = tl.maximum(prefix_len + diag_start - window + 1, 0)
            prefix_start = (prefix_start // BLOCK_N) * BLOCK_N
            tail_start = tl.maximum(prefix_start, prefix_full)  # past prefix_len: no tail
        if PREFETCH_PAGES:  # page ids one block ahead: K/V addresses never wait on the table
            first = prefix_start + offs_n
            pages = tl.load(pt_row + first // PAGE_SIZE, mask=first < prefix_len, other=0)
        for start_n in tl.range(prefix_start, prefix_full, BLOCK_N):
            if PREFETCH_PAGES:
                slot = pages.to(tl.int64) * PAGE_SIZE + (start_n + offs_n) % PAGE_SIZE
                nxt = start_n + BLOCK_N + offs_n
                pages = tl.load(pt_row + nxt // PAGE_SIZE, mask=nxt < prefix_len, other=0)
            else:
                pos = start_n + offs_n
                page = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64)
                slot = page * PAGE_SIZE + pos % PAGE_SIZE
            k = _load(kc_base + slot[None, :] * stride_kcs + offs_d[:, None], d_mask[:, None],
                      PAD_D)
            v = _load(vc_base + slot[:, None] * stride_vcs + offs_d[None, :], d_mask[None, :],
                      PAD_D)
            qk = dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
            qk = _in_window(qk, q_pos, start_n, offs_n, prefix_len + new_edge, window, SLIDING)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION,
                                          DOT_UPCAST)
        if tail_start < prefix_len:
            pos = prefix_full + offs_n
            valid = pos < prefix_len
            if not PREFETCH_PAGES:
                pages = tl.load(pt_row + pos // PAGE_SIZE, mask=valid, other=0)
            slot = pages.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
            k = tl.load(
                kc_base + slot[None, :] * stride_kcs + offs_d[:, None],
                mask=valid[None, :] & d_mask[:, None],
                other=0.0,
            )
            v = tl.load(
                vc_base + slot[:, None] * stride_vcs + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :],
                other=0.0,
            )
            qk = dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
            qk = tl.where(valid[None, :], qk, float("-inf"))
            qk = _in_window(qk, q_pos, prefix_full, offs_n, prefix_len + new_edge, window,
                            SLIDING)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION,
                                          DOT_UPCAST)

    # (b) new tokens below the diagonal block: keys in bounds and, without a window, visible
    k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * HEAD_DIM
    v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * HEAD_DIM
    new_start = 0
    if SLIDING:
        new_start = (tl.maximum(diag_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start_n in tl.range(new_start, diag_start, BLOCK_N):
        if USE_TMA:
            k = k_desc.load([q_start + start_n, kvh * HEAD_DIM]).T
            v = v_desc.load([q_start + start_n, kvh * HEAD_DIM])
        else:
            rows = start_n + offs_n
            k = _load(k_base + rows[None, :] * stride_kt + offs_d[:, None], d_mask[:, None], PAD_D)
            v = _load(v_base + rows[:, None] * stride_vt + offs_d[None, :], d_mask[None, :], PAD_D)
        qk = dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
        qk = _in_window(qk, offs_m, start_n, offs_n, new_edge, window, SLIDING)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION, DOT_UPCAST)

    # (c) the diagonal: causal mask; keys past q_len load as 0 so padded rows stay finite (with
    # a window, padded rows past the last block can see no key: 0 / 0, never stored)
    diag_end = tl.minimum(diag_start + ROWS, q_len)
    for start_n in range(diag_start, diag_end, BLOCK_N):
        rows = start_n + offs_n
        valid = rows < q_len
        k = tl.load(
            k_base + rows[None, :] * stride_kt + offs_d[:, None],
            mask=valid[None, :] & d_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + rows[:, None] * stride_vt + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        qk = dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
        qk = tl.where(offs_m[:, None] >= rows[None, :], qk, float("-inf"))
        qk = _in_window(qk, offs_m, start_n, offs_n, new_edge, window, SLIDING)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION, DOT_UPCAST)

    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + cols + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    if STORE_KV:
        # one program per KV head and q-block stores each new row once; prefix loops never read it
        if stores_kv:
            for start_n in range(diag_start, diag_end, BLOCK_N):
                rows = start_n + offs_n
                valid = rows < q_len
                mask = valid[:, None] & d_mask[None, :]
                slot = tl.load(slot_ptr + q_start + rows, mask=valid, other=0).to(tl.int64)
                k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=mask)
                tl.store(kc_base + slot[:, None] * stride_kcs + offs_d[None, :], k, mask=mask)
                v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=mask)
                tl.store(vc_base + slot[:, None] * stride_vcs + offs_d[None, :], v, mask=mask)
