"""Custom ops (`torch.ops.prefill.*`) for the kernels, and the dispatch functions the model calls.

Each op is registered with `torch.library.triton_op` and launches through `wrap_triton`, so CUDA
graph capture records the launches and torch.compile can trace into them; each has a fake
(meta) implementation. All ops write into caller-provided outputs (out-variants): no allocation
inside an op, static buffers stay static under graph capture.

The dispatch functions pick the implementation per call: `use_triton=None` means Triton on CUDA
tensors and the PyTorch reference on CPU tensors; True forces Triton (on CPU that needs
TRITON_INTERPRET=1 set before triton is imported, which the caller's config decides); False
forces the reference. Nothing here reads the environment. On the Triton path, code being traced
by torch.compile calls the custom op; eager code calls the launcher directly, because the
custom-op dispatcher adds ~45 us of host time per call (110 vs 67 us for extend_attention on the
H200 host) and the attention break runs eagerly once per layer. CUDA-graph capture records the
same kernel launch either way.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from kernels import activation, kv_store, linear, logits_summary, rope
from kernels import extend_attention as attn
from kernels import rms_norm as norm
from kernels._triton import HAS_TRITON

Tensor = torch.Tensor


def _resolve(x: Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton and not HAS_TRITON:
        raise ImportError("use_triton=True but triton is not installed; use the PyTorch path")
    return use_triton


def _traced() -> bool:
    """True under torch.compile: go through the custom op so the compiler sees the kernel."""
    return torch.compiler.is_compiling()


# ---- custom ops -------------------------------------------------------------------------------


@triton_op("prefill::rms_norm", mutates_args={"out"})
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, out: Tensor,
                 layer: Tensor | None = None, offset: int = 0) -> None:
    norm.rms_norm(x, weight, eps, out, layer=layer, offset=offset, wrap=wrap_triton)


@triton_op("prefill::fused_add_rms_norm", mutates_args={"x", "residual"})
def _fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           layer: Tensor | None = None, offset: int = 0) -> None:
    norm.fused_add_rms_norm(x, residual, weight, eps, layer=layer, offset=offset,
                            wrap=wrap_triton)


@triton_op("prefill::indexed_linear", mutates_args={"out"})
def _indexed_linear_op(x: Tensor, w: Tensor, bias: Tensor | None, layer: Tensor, offset: int,
                       out: Tensor, accumulate: bool = False) -> None:
    linear.indexed_linear(x, w, bias, layer, offset, out, accumulate=accumulate,
                          wrap=wrap_triton)


@triton_op("prefill::apply_rope", mutates_args={"q", "k", "v"})
def _apply_rope_op(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                   v: Tensor | None = None, norm_rows: Tensor | None = None, eps: float = 0.0,
                   bias: Tensor | None = None, layer: Tensor | None = None,
                   offset: int = 0) -> None:
    rope.apply_rope(q, k, positions, cos_sin_cache, v=v, norm_rows=norm_rows, eps=eps,
                    bias=bias, layer=layer, offset=offset, wrap=wrap_triton)


@triton_op("prefill::silu_and_mul", mutates_args={"out"})
def _silu_and_mul_op(x: Tensor, out: Tensor, norm_rows: Tensor | None = None,
                     eps: float = 0.0) -> None:
    activation.silu_and_mul(x, out, norm_rows=norm_rows, eps=eps, wrap=wrap_triton)


@triton_op("prefill::store_kv", mutates_args={"k_cache", "v_cache"})
def _store_kv_op(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping, wrap=wrap_triton)


@triton_op("prefill::extend_attention", mutates_args={"out", "lse"})
def _extend_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    page_table: Tensor,
    page_size: int,
    max_q_len: int,
    sm_scale: float,
    out: Tensor,
    lse: Tensor | None,
    max_prefix_len: int = -1,
) -> None:
    attn.extend_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens_q,
        prefix_lens,
        page_table,
        page_size,
        max_q_len,
        sm_scale,
        out=out,
        lse=lse,
        wrap=wrap_triton,
        max_prefix_len=None if max_prefix_len < 0 else max_prefix_len,
    )


@triton_op("prefill::logits_summary", mutates_args={"out", "logits_out"})
def _logits_summary_op(logits: Tensor, k: int, out: Tensor, logits_out: Tensor | None) -> None:
    logits_summary.logits_summary(logits, k, out, logits_out, wrap=wrap_triton)


def _no_output(*args, **kwargs) -> None:
    """Fake implementation of an out-variant op: it returns nothing and allocates nothing."""
    return None


for _op in (
    _rms_norm_op,
    _fused_add_rms_norm_op,
    _indexed_linear_op,
    _apply_rope_op,
    _silu_and_mul_op,
    _store_kv_op,
    _extend_attention_op,
    _logits_summary_op,
):
    _op.register_fake(_no_output)


# ---- dispatch -----------------------------------------------------------------------------------


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
    use_triton: bool | None = None, layer: Tensor | None = None, offset: int = 0
) -> Tensor:
    """rms_norm(x) * weight in x's dtype; x (T, N). With `layer` (int32 (1,) on the device):
    weight is an (L, N) stack of every layer's, and row layer[0] + offset is used."""
    if not _resolve(x, use_triton):
        return norm.rms_norm_ref(x, weight, eps, out, layer, offset)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if _traced():
        torch.ops.prefill.rms_norm(x, weight, eps, out, layer, offset)
        return out
    return norm.rms_norm(x, weight, eps, out, layer=layer, offset=offset)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, use_triton: bool | None = None,
    layer: Tensor | None = None, offset: int = 0
) -> tuple[Tensor, Tensor]:
    """In place: residual <- x + residual; x <- rms_norm(residual) * weight; returns both.
    `layer`/`offset` as in `rms_norm`."""
    if not _resolve(x, use_triton):
        return norm.fused_add_rms_norm_ref(x, residual, weight, eps, layer, offset)
    if _traced():
        torch.ops.prefill.fused_add_rms_norm(x, residual, weight, eps, layer, offset)
        return x, residual
    return norm.fused_add_rms_norm(x, residual, weight, eps, layer=layer, offset=offset)


def indexed_linear(
    x: Tensor, w: Tensor, bias: Tensor | None, layer: Tensor, offset: int = 0,
    out: Tensor | None = None, use_triton: bool | None = None, accumulate: bool = False
) -> Tensor:
    """x (M, K) @ w[layer[0] + offset]^T (+ bias[...]): w an (L, N, K) stack, layer int32 (1,)
    on the device, so one captured launch serves every layer (kernels/linear.py).
    `accumulate`: out += that (out required)."""
    if not _resolve(x, use_triton):
        return linear.indexed_linear_ref(x, w, bias, layer, offset, out, accumulate)
    if out is None:
        assert not accumulate, "accumulate needs an out"
        out = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    if _traced():
        torch.ops.prefill.indexed_linear(x, w, bias, layer, offset, out, accumulate)
        return out
    return linear.indexed_linear(x, w, bias, layer, offset, out, accumulate=accumulate)


def apply_rope(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    use_triton: bool | None = None,
    *,
    v: Tensor | None = None,
    norm_rows: Tensor | None = None,
    eps: float = 0.0,
    bias: Tensor | None = None,
    layer: Tensor | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Neox-style RoPE on q (T, H, D) and k (T, KVH, D), in place. Returns (q, k).
    With `norm_rows`: the folded-norm QKV epilogue (q, k, v scaled per token, bias added
    first; kernels/rope.py)."""
    kw = dict(v=v, norm_rows=norm_rows, eps=eps, bias=bias, layer=layer, offset=offset)
    if not _resolve(q, use_triton):
        return rope.apply_rope_ref(q, k, positions, cos_sin_cache, **kw)
    if _traced():
        torch.ops.prefill.apply_rope(q, k, positions, cos_sin_cache, **kw)
        return q, k
    return rope.apply_rope(q, k, positions, cos_sin_cache, **kw)


def silu_and_mul(x: Tensor, out: Tensor | None = None, use_triton: bool | None = None, *,
                 norm_rows: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """x (T, 2F) -> silu(x[:, :F]) * x[:, F:]; with `norm_rows` (T, hidden), gate and up are
    first scaled by each row's 1/rms (the folded post-attention norm; kernels/activation.py)."""
    if not _resolve(x, use_triton):
        return activation.silu_and_mul_ref(x, out, norm_rows=norm_rows, eps=eps)
    if out is None:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    if _traced():
        torch.ops.prefill.silu_and_mul(x, out, norm_rows, eps)
        return out
    return activation.silu_and_mul(x, out, norm_rows=norm_rows, eps=eps)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    use_triton: bool | None = None,
) -> None:
    """k_cache[slot_mapping[t]] = k[t], v_cache[slot_mapping[t]] = v[t]."""
    if not _resolve(k, use_triton):
        kv_store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    if _traced():
        torch.ops.prefill.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping)


def extend_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    page_table: Tensor,
    page_size: int,
    max_q_len: int,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: Tensor | None = None,
    use_triton: bool | None = None,
    max_prefix_len: int | None = None,
    num_tokens: int | None = None,
):
    """Prefix + causal attention over a varlen batch; see kernels/extend_attention.py.

    Returns o (T, H, D), or (o, lse) when return_lse. Rows past cu_seqlens_q[-1] are not written.
    `max_prefix_len`, `num_tokens` (host-side, optional): the longest cached prefix and
    cu_seqlens_q[-1]; they let prefix-free batches take faster kernels (see
    kernels/extend_attention.prepare_extend_attention).
    """
    args = (q, k, v, k_cache, v_cache, cu_seqlens_q, prefix_lens, page_table, page_size, max_q_len)
    if not _resolve(q, use_triton):
        return attn.extend_attention_ref(*args, sm_scale, return_lse, out)
    if not _traced():
        return attn.extend_attention(*args, sm_scale, return_lse, out,
                                     max_prefix_len=max_prefix_len, num_tokens=num_tokens)
    T, H, D = q.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if return_lse else None
    scale = sm_scale if sm_scale is not None else D**-0.5
    torch.ops.prefill.extend_attention(*args, scale, out, lse,
                                       -1 if max_prefix_len is None else max_prefix_len)
    return (out, lse) if return_lse else out


def summarize_logits(logits: Tensor, k: int, out: Tensor | None = None,
                     logits_out: Tensor | None = None, use_triton: bool | None = None) -> Tensor:
    """(B, 2 + 2k) float64 from (B, V) logits: greedy id, its logprob, top-k ids and logprobs
    (kernels/logits_summary.py); with `logits_out` (B, V) fp32, the logits copied there too."""
    if not _resolve(logits, use_triton):
        return logits_summary.logits_summary_ref(logits, k, out, logits_out)
    if out is None:
        out = torch.empty((logits.shape[0], 2 + 2 * k), dtype=torch.float64,
                          device=logits.device)
    if _traced():
        torch.ops.prefill.logits_summary(logits, k, out, logits_out)
        return out
    return logits_summary.logits_summary(logits, k, out, logits_out)
