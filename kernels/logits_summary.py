"""Each logits row's greedy token and top-k logprobs in two launches: per-chunk max, sum of exp and
top-k partials, then a per-row merge. Ties go to the lowest id, as torch.argmax does."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

CHUNK = 4096


@triton.jit
def _chunk_kernel(
    x_ptr, logits_out_ptr, part_ptr, cand_v_ptr, cand_i_ptr,
    V, stride_x, stride_o, n_chunks,
    K: tl.constexpr, CHUNK: tl.constexpr, WRITE_LOGITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if WRITE_LOGITS:
        tl.store(logits_out_ptr + row * stride_o + offs, x, mask=mask)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp2((x - m) * 1.4426950408889634), axis=0)
    part = part_ptr + (row * n_chunks + c) * 2
    tl.store(part, m)
    tl.store(part + 1, s)
    cand = (row * n_chunks + c) * K
    for i in range(K):
        v = tl.max(x, axis=0)
        # clamped: a NaN row matches nothing, and no id past the vocabulary may escape
        idx = tl.minimum(tl.min(tl.where(x == v, offs, 2147483647), axis=0), V - 1)
        tl.store(cand_v_ptr + cand + i, v)
        tl.store(cand_i_ptr + cand + i, idx)
        x = tl.where(offs == idx, float("-inf"), x)


@triton.jit
def _merge_kernel(
    part_ptr, cand_v_ptr, cand_i_ptr, out_ptr,
    V, n_chunks, stride_out,
    K: tl.constexpr, CHUNKS_PAD: tl.constexpr, CANDS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, CHUNKS_PAD)
    part = part_ptr + (row * n_chunks + cs) * 2
    m = tl.load(part, mask=cs < n_chunks, other=float("-inf"))
    s = tl.load(part + 1, mask=cs < n_chunks, other=0.0)
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp2((m - big) * 1.4426950408889634), axis=0))
    j = tl.arange(0, CANDS_PAD)
    n = n_chunks * K
    v = tl.load(cand_v_ptr + row * n + j, mask=j < n, other=float("-inf"))
    ids = tl.load(cand_i_ptr + row * n + j, mask=j < n, other=2147483647)
    out = out_ptr + row * stride_out
    for i in range(K):
        best = tl.max(v, axis=0)
        idx = tl.minimum(tl.min(tl.where(v == best, ids, 2147483647), axis=0), V - 1)
        if i == 0:  # the greedy token: the best id, lowest id on ties
            tl.store(out, idx.to(tl.float64))
            tl.store(out + 1, (best - lse).to(tl.float64))
        tl.store(out + 2 + i, idx.to(tl.float64))
        tl.store(out + 2 + K + i, (best - lse).to(tl.float64))
        v = tl.where(ids == idx, float("-inf"), v)


def logits_summary(logits: torch.Tensor, k: int, out: torch.Tensor,
                   logits_out: torch.Tensor | None = None, *, wrap=None) -> torch.Tensor:
    """out (B, 2+2k) f64: greedy id, logprob, k ids, logprobs; `logits_out` (B, V) fp32: logits."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be (B, V), last dim packed"
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{logits.dtype}"
    b, v = logits.shape
    assert 0 < k <= v, f"k={k} must be in [1, {v}]"
    assert out.shape == (b, 2 + 2 * k) and out.dtype == torch.float64 and out.stride(1) == 1
    if logits_out is not None:
        assert logits_out.shape == (b, v) and logits_out.dtype == torch.float32
        assert logits_out.stride(1) == 1, "logits_out: last dim must be packed"
    if b == 0:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    part = torch.empty(b, n_chunks, 2, dtype=torch.float32, device=logits.device)
    cand_v = torch.empty(b, n_chunks * k, dtype=torch.float32, device=logits.device)
    cand_i = torch.empty(b, n_chunks * k, dtype=torch.int32, device=logits.device)
    first = wrap(_chunk_kernel) if wrap is not None else _chunk_kernel
    second = wrap(_merge_kernel) if wrap is not None else _merge_kernel
    first[(b, n_chunks)](
        logits, logits_out if logits_out is not None else logits, part, cand_v, cand_i,
        v, logits.stride(0), logits_out.stride(0) if logits_out is not None else 0, n_chunks,
        K=k, CHUNK=chunk, WRITE_LOGITS=logits_out is not None, num_warps=8 if chunk >= 2048 else 4)
    second[(b,)](
        part, cand_v, cand_i, out, v, n_chunks, out.stride(0),
        K=k, CHUNKS_PAD=triton.next_power_of_2(n_chunks),
        CANDS_PAD=triton.next_power_of_2(n_chunks * k), num_warps=4)
    return out


def logits_summary_ref(logits: torch.Tensor, k: int, out: torch.Tensor | None = None,
                       logits_out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference: fp32 log_softmax, torch.argmax, torch.topk."""
    x = logits.float()
    if logits_out is not None:
        logits_out.copy_(x)
    lp = torch.log_softmax(x, dim=-1)
    ids = torch.argmax(x, dim=-1, keepdim=True)
    vals, top = torch.topk(lp, k, dim=-1)
    packed = torch.cat([ids.double(), lp.gather(-1, ids).double(), top.double(), vals.double()],
                       dim=-1)
    return packed if out is None else out.copy_(packed)
