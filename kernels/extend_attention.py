"""Prefill ("extend") attention over a varlen batch whose cached prefix lives in a paged KV pool.

Algorithm: FlashAttention-2 forward (Dao, 2023) with an exp2 online softmax (log2(e) folded into
the scale) and fp32 accumulation. One program owns BLOCK_M query rows of one sequence and one
query head and walks three key ranges in order, so that only the last one pays for masking:
  (a) the cached prefix, gathered from the pool through the page table (bounds mask on the tail
      block only);
  (b) new-token blocks strictly below the diagonal, read straight from k/v, unmasked;
  (c) the diagonal block(s), causal-masked.
Grid (cdiv(max_q_len, BLOCK_M), H, B), or (H, cdiv(max_q_len, BLOCK_M), B) with heads_first;
program 0 of a sequence takes its LAST query block (the most work), so heavy blocks start first
and the tail of the launch is short blocks. Heads sharing a KV head are neighbours in the grid.

Shapes: q (T, H, D), k/v (T, KVH, D) with any H % KVH == 0; rows may be strided (slices of a
fused qkv buffer) but each row's heads must be packed (stride(1) == D, stride(2) == 1). D in
{64, 128} natively; other D up to 256 are padded to a power of two with masks. T may exceed
cu_seqlens_q[-1]: those padded rows are never read as keys and never written (a caller's `out`
keeps its contents there; a fresh output holds uninitialised values there). Sequences with 0 new
tokens are skipped.

On a Hopper GPU, batches known to be prefix-free (head_dim 128, enough rows) go to the
warp-specialized Gluon kernel of extend_attention_sm90.py instead: see prepare_extend_attention.

Trade-off: the grid is sized by max_q_len, so a batch of one long and many short sequences
launches programs that exit at once; that costs microseconds and needs no device-side block map
(no host sync, one launch). Prefix blocks are gathered with per-row loads (page ids fetched one
block ahead); measured on an H200 that beat TMA loads of whole pages. Optional TMA loads
(USE_TMA) cover the unmasked new-token blocks only; masked blocks always use plain masked loads,
so no stale pool slot or padded row can leak NaN into the accumulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import extend_attention_sm90 as sm90
from kernels import kv_store
from kernels._triton import dot as _dot
from kernels._triton import dot_flags, tl, triton
from kernels.extend_attention_config import INTERPRETER_CONFIG, AttnConfig, pick_config
from kernels.launch import LastLaunch, Relauncher

__all__ = [
    "INTERPRETER_CONFIG",
    "AttnConfig",
    "extend_attention",
    "extend_attention_ref",
    "pick_config",
    "prepare_extend_attention",
]

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


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
    acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


# NOTE: the page table's row stride is the batch's widest page list, which varies from batch to
# batch; specialized (== 1, % 16 == 0) it made a new batch compile a new variant on the serving
# path (H200: 892 ms for the first prompt over 1,024 tokens whose stride was not a multiple of 16
# after capture's were). Not specializing it costs nothing measurable: page ids are 4-byte loads.
@triton.jit(do_not_specialize=["stride_ptb"])
def _extend_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    lse_ptr,
    k_desc,
    v_desc,
    cu_seqlens_q_ptr,
    prefix_lens_ptr,
    page_table_ptr,
    slot_ptr,
    qk_scale,
    kv_group,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_kcs,
    stride_vcs,
    stride_ot,
    stride_lset,
    stride_ptb,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    STORE_KV: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    CACHE_TABLE: tl.constexpr,
):
    if HEADS_FIRST:  # grid (H, n_m, B): all heads of the longest q-blocks launch first
        h = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:  # grid (n_m, H, B): one head's q-blocks, longest first, share its K/V in L2
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    m_block = tl.cdiv(q_len, BLOCK_M) - 1 - pid_m  # longest-work-first within the sequence
    if m_block < 0:
        return
    prefix_len = tl.load(prefix_lens_ptr + b)
    kvh = h // kv_group
    if CACHE_TABLE:  # the caches' addresses are data: a captured graph reads them at replay
        # NOTE: a loaded address carries no alignment facts; without multiple_of the KV store
        # and prefix loads go scalar (H200: 6 -> 13 us per launch at 128 tokens).
        elt = tl.pointer_type(q_ptr.dtype.element_ty)
        k_cache_ptr = tl.multiple_of(tl.load(k_cache_ptr).to(elt), 16)
        v_cache_ptr = tl.multiple_of(tl.load(v_cache_ptr).to(elt), 16)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * HEAD_DIM + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, D)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked row stays NaN-free

    # (a) cached prefix, read through the page table (compiled out for prefix-free batches:
    # its gather addresses cost registers the other loops need).
    kc_base = k_cache_ptr + kvh * HEAD_DIM  # also the fused KV store's target
    vc_base = v_cache_ptr + kvh * HEAD_DIM
    if HAS_PREFIX:
        pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
        prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
        if PREFETCH_PAGES:
            # NOTE: page ids loaded one block ahead, so block j's K/V addresses never wait on its
            # page-table load (H200, D=128, 1k new + 8k cached: 264 -> 410 TFLOP/s).
            pages = tl.load(pt_row + offs_n // PAGE_SIZE, mask=offs_n < prefix_len, other=0)
        for start_n in tl.range(0, prefix_full, BLOCK_N):
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
            qk = _dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION,
                                          DOT_UPCAST)
        if prefix_full < prefix_len:
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
            qk = _dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
            qk = tl.where(valid[None, :], qk, float("-inf"))
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION,
                                          DOT_UPCAST)

    # (b) new tokens strictly below the diagonal block: every key is visible and in bounds.
    k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * HEAD_DIM
    v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * HEAD_DIM
    diag_start = m_block * BLOCK_M
    for start_n in tl.range(0, diag_start, BLOCK_N):
        if USE_TMA:
            k = k_desc.load([q_start + start_n, kvh * HEAD_DIM]).T
            v = v_desc.load([q_start + start_n, kvh * HEAD_DIM])
        else:
            rows = start_n + offs_n
            k = _load(k_base + rows[None, :] * stride_kt + offs_d[:, None], d_mask[:, None], PAD_D)
            v = _load(v_base + rows[:, None] * stride_vt + offs_d[None, :], d_mask[None, :], PAD_D)
        qk = _dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION, DOT_UPCAST)

    # (c) the diagonal: causal mask; keys past q_len load as 0 so padded rows stay finite.
    diag_end = tl.minimum(diag_start + BLOCK_M, q_len)
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
        qk = _dot(q, k, None, DOT_PRECISION, DOT_UPCAST)
        qk = tl.where(offs_m[:, None] >= rows[None, :], qk, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale, DOT_PRECISION, DOT_UPCAST)

    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + h * HEAD_DIM + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 units -> natural log
        tl.store(lse_ptr + q_rows * stride_lset + h, lse, mask=m_mask)
    if STORE_KV:
        # The fused KV store: one head per KV group writes its q-block's rows, so the programs
        # cover every new row exactly once. No program reads these slots (the prefix part reads
        # only slots below each sequence's prefix length), so it cannot race. NOTE: here, after
        # the output, with its own row-major loads: storing the diagonal loop's K/V tiles
        # instead slowed the whole kernel (H200, 32q/8kv D64, one 8k prompt: 811 vs 640 us;
        # bench/results/attention-store-*).
        if h % kv_group == 0:
            for start_n in range(diag_start, diag_end, BLOCK_N):
                rows = start_n + offs_n
                valid = rows < q_len
                mask = valid[:, None] & d_mask[None, :]
                slot = tl.load(slot_ptr + q_start + rows, mask=valid, other=0).to(tl.int64)
                k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=mask)
                tl.store(kc_base + slot[:, None] * stride_kcs + offs_d[None, :], k, mask=mask)
                v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=mask)
                tl.store(vc_base + slot[:, None] * stride_vcs + offs_d[None, :], v, mask=mask)


def _tma_descriptor(x: torch.Tensor, block_n: int, head_dim: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, heads, d = x.shape  # (rows, KVH, D) with contiguous (KVH, D) -> 2-D (rows, KVH * D)
    return TensorDescriptor(x, [rows, heads * d], [x.stride(0), 1], [block_n, head_dim])


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    max_q_len: int,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    *,
    lse: torch.Tensor | None = None,
    config: AttnConfig | None = None,
    wrap=None,
    max_prefix_len: int | None = None,
    num_tokens: int | None = None,
):
    """Causal attention of each sequence's new tokens to its cached prefix and to themselves
    (see `prepare_extend_attention` for the contract). Returns o, or (o, lse) with return_lse.

    A call that repeats the previous one's q, k, v and metadata tensors (caches, out and lse may
    differ) reuses its bound launch (`_LAST`): on the H200's host 16 us per call instead of 78
    (plain kernel; bench/attention.py's launch_overhead) and ~90 (Hopper kernel, whose three TMA
    descriptors are then re-encoded, not rebuilt), more than the GPU needs below ~1k tokens.
    """
    tensors = (q, k, v, cu_seqlens_q, prefix_lens, page_table)
    key = None
    if wrap is None and lse is None and q.is_cuda:
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.stride(0), k.stride(0),
               v.stride(0), q.dtype, tuple(page_table.shape), page_size, max_q_len, sm_scale,
               return_lse, config, max_prefix_len, num_tokens, tuple(k_cache.shape),
               k_cache.stride(0), v_cache.stride(0), k_cache.dtype, k_cache.data_ptr() % 16,
               v_cache.data_ptr() % 16,
               None if out is None else (out.stride(0), out.data_ptr() % 16))
        run = _LAST.lookup(key, tensors)
        if run is not None:
            out = torch.empty_like(q) if out is None else out
            lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
            run(k_cache, v_cache, out, out if lse is None else lse)
            return (out, lse) if return_lse else out
    if _use_sm90(q, k, v, out, max_prefix_len, num_tokens, lse, return_lse, config, wrap):
        bound, out = sm90.prepare_sm90(q, k, v, cu_seqlens_q, max_q_len, sm_scale, out,
                                       num_tokens=num_tokens)
        if bound is not None:
            bound(out)
            if key is not None and bound.detach():
                _LAST.store(key, tensors, lambda kc, vc, o, lse_slot, _b=bound: _b(o))
        return out
    bound, out, lse = _bind(
        q, k, v, k_cache, v_cache, cu_seqlens_q, prefix_lens, page_table, page_size, max_q_len,
        sm_scale, out, lse=lse, return_lse=return_lse, config=config, wrap=wrap,
        max_prefix_len=max_prefix_len, store_slots=None, swap=(3, 4, 5, 6), cache_table=None)
    if bound is not None:
        bound(k_cache, v_cache, out, out if lse is None else lse)
        if key is not None and bound.detach():
            _LAST.store(key, tensors, bound)
    return (out, lse) if return_lse else out


_LAST = LastLaunch()


def prepare_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    max_q_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    config: AttnConfig | None = None,
    wrap=None,
    store_slots: torch.Tensor | None = None,
    max_prefix_len: int | None = None,
    num_tokens: int | None = None,
    cache_table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], None] | None, torch.Tensor,
           torch.Tensor | None]:
    """Causal attention of each sequence's new tokens to its cached prefix and to themselves.

    max_q_len must be >= the longest sequence's new-token count (an upper bound is fine).
    `wrap` (e.g. torch.library.wrap_triton) is applied to the kernel before launch.
    `store_slots` (T,): also write k and v into the caches at these slots (the KV store fused
    into the same launch: one launch per layer in a graph break instead of two).
    Host-side facts a caller may know (they pick faster code; None assumes the general case):
    `max_prefix_len` the longest cached prefix (0: the kernel compiled without the prefix loop),
    `num_tokens` = cu_seqlens_q[-1]. Both known and 0 prefix, on a Hopper GPU with head_dim 128
    and >= SM90_MIN_TOKENS_PREPARED rows (SM90_MIN_TOKENS for one-call extend_attention): the
    warp-specialized kernel of extend_attention_sm90.py, which reads k/v through TMA bounded at
    num_tokens rows (padding rows are never read either way).
    Returns (launch, o, lse): everything is checked and bound once; `launch(k_cache, v_cache)`
    runs the kernel on one layer's cache (None when there is nothing to compute). o is (T, H, D);
    lse (T, H) fp32 natural-log, or None unless return_lse / `lse` was given.

    `cache_table` (a, b): the kernel reads each cache's base address from memory instead, and
    `launch(a_i, b_i)` takes one-element int64 tensors holding a layer's K and V cache addresses
    (a, b: the first layer's, for binding); k_cache/v_cache then only fix shape, dtype and
    strides. A captured graph then replays on whatever pool those addresses name when it runs,
    so the pool can be allocated after capture (the plain kernel only).
    """
    if cache_table is None and _use_sm90(q, k, v, out, max_prefix_len, num_tokens, lse,
                                         return_lse, config, wrap, SM90_MIN_TOKENS_PREPARED):
        attend, out = sm90.prepare_sm90(q, k, v, cu_seqlens_q, max_q_len, sm_scale, out,
                                        num_tokens=num_tokens)
        store = (kv_store.prepare_store_kv(k, v, k_cache, v_cache, store_slots)
                 if store_slots is not None else None)
        if attend is None:
            return None, out, None

        def launch_sm90(kc: torch.Tensor, vc: torch.Tensor) -> None:
            if store is not None:  # a separate launch: this kernel never touches the caches
                store(kc, vc)
            attend(out)
        return launch_sm90, out, None
    kernel, out, lse = _bind(
        q, k, v, k_cache, v_cache, cu_seqlens_q, prefix_lens, page_table, page_size, max_q_len,
        sm_scale, out, lse=lse, return_lse=return_lse, config=config, wrap=wrap,
        store_slots=store_slots, max_prefix_len=max_prefix_len, swap=(3, 4),
        cache_table=cache_table)
    if kernel is None:
        return None, out, lse
    shape = k_cache.shape if cache_table is None else (1,)

    def launch(kc: torch.Tensor, vc: torch.Tensor) -> None:
        # NOTE: every layer's cache shares the prepared one's shape, dtype and strides (one KV
        # pool allocates them alike); only the pointers change, so nothing is re-checked here.
        assert kc.shape == shape and vc.shape == shape, "cache differs from the prepared one"
        kernel(kc, vc)

    return launch, out, lse


# Below these row counts the plain kernel serves prefix-free batches too. The Hopper kernel binds
# three TMA descriptors per call: ~90 us of host time on the H200's host for a one-call launch,
# more than the GPU needs below ~4k rows (bench/results/attention-s4-*, "eager" rows). A graph
# break binds once per batch and relaunches in ~27 us per layer, plus a separate KV-store launch.
SM90_MIN_TOKENS = 4096  # one call (extend_attention)
SM90_MIN_TOKENS_PREPARED = 1024  # prepared once, launched per layer (prepare_extend_attention)


def _use_sm90(q, k, v, out, max_prefix_len, num_tokens, lse, return_lse, config, wrap,
              min_tokens: int = SM90_MIN_TOKENS) -> bool:
    """The Hopper kernel (kernels/extend_attention_sm90.py) takes a batch when it is known to
    be prefix-free with its live row count, large enough, head_dim 128 (at 64 the plain kernel
    measured faster), needs no lse, no explicit config and no tracing wrapper, and TMA can read
    its tensors."""
    if max_prefix_len != 0 or num_tokens is None or lse is not None or return_lse:
        return False
    if config is not None or wrap is not None or q.shape[2] != 128:
        return False
    if num_tokens < min_tokens or num_tokens > q.shape[0]:
        return False
    return sm90.supported(q, k, v, *(() if out is None else (out,)))


def _bind(q, k, v, k_cache, v_cache, cu_seqlens_q, prefix_lens, page_table, page_size, max_q_len,
          sm_scale, out, *, lse, return_lse, config, wrap, store_slots, max_prefix_len,
          swap, cache_table) -> tuple[Relauncher | None, torch.Tensor, torch.Tensor | None]:
    """Check and bind one launch (see prepare_extend_attention): (launcher whose arguments at
    `swap` are given per call, o, lse)."""
    T, H, D = q.shape
    KVH = k.shape[1]
    B = prefix_lens.shape[0]
    dtype = q.dtype
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}"
    assert H % KVH == 0, f"H={H} not a multiple of KVH={KVH}"
    assert D <= 256, f"head_dim {D} > 256"
    for name, x, rows in (("q", q, T), ("k", k, T), ("v", v, T), ("k_cache", k_cache, None),
                          ("v_cache", v_cache, None)):  # fmt: skip
        assert x.dtype == dtype, f"{name} is {x.dtype}, q is {dtype}"
        assert x.dim() == 3 and x.shape[1] * D == x.shape[1] * x.shape[2], f"{name} shape"
        assert x.shape[2] == D and (rows is None or x.shape[0] == rows), f"{name} shape"
        assert x.stride(2) == 1 and x.stride(1) == D, f"{name}: heads must be packed, contiguous"
    assert k.shape[1] == v.shape[1] == k_cache.shape[1] == v_cache.shape[1], "KV heads differ"
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("prefix_lens", prefix_lens),
                    ("page_table", page_table)):  # fmt: skip
        assert x.dtype == torch.int32, f"{name} must be int32, got {x.dtype}"
        assert x.device == q.device, f"{name} on {x.device}, q on {q.device}"
    assert cu_seqlens_q.shape[0] == B + 1, "cu_seqlens_q must be (B + 1,)"
    assert page_table.dim() == 2 and page_table.shape[0] == B and page_table.stride(1) == 1
    assert k_cache.shape[0] % page_size == 0, "cache slots must be whole pages"
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    assert scale > 0, "sm_scale must be positive"
    if out is None:
        out = torch.empty((T, H, D), dtype=dtype, device=q.device)
    assert out.shape == (T, H, D) and out.dtype == dtype, "out must be (T, H, D) in q's dtype"
    assert out.stride(2) == 1 and out.stride(1) == D, "out: heads must be packed, contiguous"
    if return_lse and lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if lse is not None:
        assert lse.shape == (T, H) and lse.dtype == torch.float32 and lse.stride(1) == 1
    if cache_table is not None:
        for x in cache_table:
            assert x.shape == (1,) and x.dtype == torch.int64 and x.device == q.device, (
                "cache_table entries must be one-element int64 tensors of cache addresses")
    if store_slots is not None:
        assert store_slots.shape == (T,) and store_slots.dtype in (torch.int32, torch.int64), (
            f"store_slots must be ({T},) int32/int64")
    if B == 0 or max_q_len <= 0 or T == 0:
        return None, out, lse

    has_prefix = max_prefix_len is None or max_prefix_len > 0
    cfg = config or pick_config(D, dtype, q.device, max_q_len)
    assert cfg.block_m % cfg.block_n == 0, "BLOCK_M must be a multiple of BLOCK_N"
    d_pad = max(16, triton.next_power_of_2(D))
    # TMA descriptors cost ~55 us of host time per launch: only worth it on large batches
    use_tma = cfg.use_tma and T >= cfg.tma_min_tokens and d_pad == D and dtype != torch.float32
    k_desc = v_desc = None
    if use_tma:
        k_desc, v_desc = (_tma_descriptor(x, cfg.block_n, D) for x in (k, v))
    n_m = triton.cdiv(max_q_len, cfg.block_m)
    grid = (H, n_m, B) if cfg.heads_first else (n_m, H, B)
    before = (q, k, v, *(cache_table or (k_cache, v_cache)))
    after = (
        out, lse if lse is not None else out, k_desc, v_desc,
        cu_seqlens_q, prefix_lens, page_table,
        store_slots if store_slots is not None else cu_seqlens_q,
        scale * _LOG2E, H // KVH,
        q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
        out.stride(0), H if lse is None else lse.stride(0), page_table.stride(0),
    )  # fmt: skip
    meta = dict(
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        RETURN_LSE=lse is not None, USE_TMA=use_tma,
        **dot_flags(dtype, q.device.type),
        HEADS_FIRST=cfg.heads_first, PREFETCH_PAGES=cfg.prefetch_pages,
        STORE_KV=store_slots is not None, HAS_PREFIX=has_prefix,
        CACHE_TABLE=cache_table is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip

    kernel = Relauncher(_extend_attention_kernel, grid, (*before, *after), meta, swap, wrap)
    return kernel, out, lse


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    max_q_len: int,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    *,
    lse: torch.Tensor | None = None,
    chunk_size: int = 4096,
):
    """PyTorch reference (and CPU serving path): per sequence, gather the prefix through the page
    table and run SDPA with a prefix+causal mask, `chunk_size` query rows at a time. With
    return_lse it uses explicit softmax math instead, in the inputs' dtype."""
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    for b, P in enumerate(prefixes):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        pos = torch.arange(P, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        kb = torch.cat([k_cache[slots], k[s:e]]).transpose(0, 1)  # (KVH, P + L, D)
        vb = torch.cat([v_cache[slots], v[s:e]]).transpose(0, 1)
        for c0 in range(0, e - s, chunk_size):
            c1 = min(e - s, c0 + chunk_size)
            n_keys = P + c1
            qc = q[s + c0 : s + c1].transpose(0, 1)  # (H, C, D)
            kc, vc = kb[:, :n_keys], vb[:, :n_keys]
            key_pos = torch.arange(n_keys, device=q.device)
            mask = key_pos[None, :] <= P + torch.arange(c0, c1, device=q.device)[:, None]
            if lse is not None:
                kc, vc = kc.repeat_interleave(group, 0), vc.repeat_interleave(group, 0)
                scores = (qc @ kc.transpose(1, 2)) * scale  # (H, C, n_keys)
                scores = scores.masked_fill(~mask, float("-inf"))
                lse[s + c0 : s + c1] = torch.logsumexp(scores.float(), -1).transpose(0, 1)
                oc = torch.softmax(scores, -1) @ vc
            else:
                oc = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=group > 1
                )
            out[s + c0 : s + c1] = oc.transpose(0, 1)
    return (out, lse) if return_lse else out
