"""The kernels as the model calls them: `use_triton=None` is Triton on CUDA tensors, else the
PyTorch reference; torch.compile uses the `torch.ops.prefill.*` op, eager code launches directly."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.library import triton_op, wrap_triton

from kernels import activation as act
from kernels import extend_attention as attn
from kernels import kv_store, logits_summary, rope
from kernels import quant_fp8 as q8
from kernels import rms_norm as norm
from kernels._triton import HAS_TRITON
from kernels.varlen import VarlenBatch

Tensor = torch.Tensor


def _kernel_op(name: str, mutates: set[str], ref: Callable, launch: Callable,
               to_op: Callable | None = None) -> Callable[[Callable], Callable]:
    """Registers `prefill::<name>`; returns `run(use_triton, *args)`: `ref`, the op or `launch`."""

    def register(body: Callable) -> Callable:
        op = triton_op(f"prefill::{name}", mutates_args=mutates)(body)
        op.register_fake(lambda *args, **kwargs: None)

        def run(use_triton: bool | None, *args, **kwargs) -> None:
            if use_triton is None:
                use_triton = args[0].is_cuda
            if not use_triton:
                ref(*args, **kwargs)
            elif not HAS_TRITON:
                raise ImportError("use_triton=True but triton is not installed; use the "
                                  "PyTorch path (use_triton=False)")
            elif torch.compiler.is_compiling():
                if to_op is not None:
                    args, kwargs = to_op(*args, **kwargs), {}
                op(*args, **kwargs)
            else:
                launch(*args, **kwargs)

        return run

    return register


@_kernel_op("rms_norm", {"out"}, norm.rms_norm_ref, norm.rms_norm)
def _rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    norm.rms_norm(x, weight, eps, out, wrap=wrap_triton)


@_kernel_op("fused_add_rms_norm", {"x", "residual"}, norm.fused_add_rms_norm_ref,
            norm.fused_add_rms_norm)
def _fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    norm.fused_add_rms_norm(x, residual, weight, eps, wrap=wrap_triton)


@_kernel_op("apply_rope", {"q", "k", "v"}, rope.apply_rope_ref, rope.apply_rope)
def _apply_rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                v: Tensor | None = None, norm_rows: Tensor | None = None, eps: float = 0.0,
                bias: Tensor | None = None, q_norm: Tensor | None = None,
                k_norm: Tensor | None = None, qk_eps: float = 0.0) -> None:
    rope.apply_rope(q, k, positions, cos_sin_cache, v=v, norm_rows=norm_rows, eps=eps, bias=bias,
                    q_norm=q_norm, k_norm=k_norm, qk_eps=qk_eps, wrap=wrap_triton)


@_kernel_op("act_and_mul", {"out"}, act.act_and_mul_ref, act.act_and_mul)
def _act_and_mul(x: Tensor, out: Tensor, activation: str = "silu",
                 norm_rows: Tensor | None = None, eps: float = 0.0) -> None:
    act.act_and_mul(x, out, activation=activation, norm_rows=norm_rows, eps=eps, wrap=wrap_triton)


@_kernel_op("quantize_fp8", {"out", "scale", "residual"}, q8.quantize_fp8_ref, q8.quantize_fp8)
def _quantize_fp8(x: Tensor, out: Tensor, scale: Tensor, group: int = 0,
                  static: Tensor | None = None, residual: Tensor | None = None,
                  weight: Tensor | None = None, eps: float = 0.0) -> None:
    q8.quantize_fp8(x, out, scale, group=group, static=static, residual=residual, weight=weight,
                    eps=eps, wrap=wrap_triton)


@_kernel_op("act_and_mul_fp8", {"out", "scale"}, q8.act_and_mul_fp8_ref, q8.act_and_mul_fp8)
def _act_and_mul_fp8(x: Tensor, out: Tensor, scale: Tensor, activation: str = "silu",
                     group: int = 0, static: Tensor | None = None) -> None:
    q8.act_and_mul_fp8(x, out, scale, activation=activation, group=group, static=static,
                       wrap=wrap_triton)


@_kernel_op("store_kv", {"k_cache", "v_cache"}, kv_store.store_kv_ref, kv_store.store_kv)
def _store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
              slot_mapping: Tensor) -> None:
    kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping, wrap=wrap_triton)


def _attention_op_args(q, k, v, k_cache, v_cache, batch: VarlenBatch, sm_scale, out,
                       window: int | None = None) -> tuple:
    """The op's arguments: torch.library takes no VarlenBatch, nor None for an int (window 0)."""
    prefix = -1 if batch.max_prefix_len is None else batch.max_prefix_len
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    return (q, k, v, k_cache, v_cache, batch.cu_seqlens_q, batch.prefix_lens, batch.page_table,
            batch.page_size, batch.max_q_len, scale, out, prefix, window or 0)


@_kernel_op("extend_attention", {"out"}, attn.extend_attention_ref, attn.extend_attention,
            to_op=_attention_op_args)
def _extend_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                      cu_seqlens_q: Tensor, prefix_lens: Tensor, page_table: Tensor,
                      page_size: int, max_q_len: int, sm_scale: float, out: Tensor,
                      max_prefix_len: int = -1, window: int = 0) -> None:
    batch = VarlenBatch(cu_seqlens_q, prefix_lens, page_table, page_size, max_q_len,
                        None if max_prefix_len < 0 else max_prefix_len)
    attn.extend_attention(q, k, v, k_cache, v_cache, batch, sm_scale, out, wrap=wrap_triton,
                          window=window)


@_kernel_op("logits_summary", {"out", "logits_out"}, logits_summary.logits_summary_ref,
            logits_summary.logits_summary)
def _logits_summary(logits: Tensor, k: int, out: Tensor, logits_out: Tensor | None) -> None:
    logits_summary.logits_summary(logits, k, out, logits_out, wrap=wrap_triton)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
             use_triton: bool | None = None) -> Tensor:
    """rms_norm(x) * weight in x's dtype; x (T, N)."""
    out = x.new_empty(x.shape) if out is None else out
    _rms_norm(use_triton, x, weight, eps, out)
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       use_triton: bool | None = None) -> tuple[Tensor, Tensor]:
    """In place: residual <- x + residual; x <- rms_norm(residual) * weight; returns both."""
    _fused_add_rms_norm(use_triton, x, residual, weight, eps)
    return x, residual


def apply_rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor,
               use_triton: bool | None = None, *, v: Tensor | None = None,
               norm_rows: Tensor | None = None, eps: float = 0.0, bias: Tensor | None = None,
               q_norm: Tensor | None = None, k_norm: Tensor | None = None,
               qk_eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """Neox RoPE on q (T, H, D) and k (T, KVH, D) in place (kernels/rope.py); returns (q, k)."""
    _apply_rope(use_triton, q, k, positions, cos_sin_cache, v=v, norm_rows=norm_rows, eps=eps,
                bias=bias, q_norm=q_norm, k_norm=k_norm, qk_eps=qk_eps)
    return q, k


def act_and_mul(x: Tensor, out: Tensor | None = None, use_triton: bool | None = None, *,
                activation: str = "silu", norm_rows: Tensor | None = None,
                eps: float = 0.0) -> Tensor:
    """x (T, 2F) -> act(x[:, :F]) * x[:, F:] (T, F), act "silu" or "gelu_tanh"."""
    out = x.new_empty((x.shape[0], x.shape[1] // 2)) if out is None else out
    _act_and_mul(use_triton, x, out, activation=activation, norm_rows=norm_rows, eps=eps)
    return out


def quantize_fp8(x: Tensor, out: Tensor, scale: Tensor, *, group: int = 0,
                 static: Tensor | None = None, residual: Tensor | None = None,
                 weight: Tensor | None = None, eps: float = 0.0,
                 use_triton: bool | None = None) -> None:
    """e4m3 rows and scales of x, optionally residual-added and RMS-normed (quant_fp8.py)."""
    _quantize_fp8(use_triton, x, out, scale, group=group, static=static, residual=residual,
                  weight=weight, eps=eps)


def act_and_mul_fp8(x: Tensor, out: Tensor, scale: Tensor, *, activation: str = "silu",
                    group: int = 0, static: Tensor | None = None,
                    use_triton: bool | None = None) -> None:
    """act(x[:, :F]) * x[:, F:] as e4m3 rows and scales (kernels/quant_fp8.py)."""
    _act_and_mul_fp8(use_triton, x, out, scale, activation=activation, group=group,
                     static=static)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             use_triton: bool | None = None) -> None:
    """k_cache[slot_mapping[t]] = k[t], v_cache[slot_mapping[t]] = v[t]."""
    _store_kv(use_triton, k, v, k_cache, v_cache, slot_mapping)


def extend_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                     batch: VarlenBatch, sm_scale: float | None = None, out: Tensor | None = None,
                     use_triton: bool | None = None, *, window: int | None = None) -> Tensor:
    """o (T, H, D): prefix + causal (or `window`) attention over a varlen batch."""
    out = q.new_empty(q.shape) if out is None else out
    _extend_attention(use_triton, q, k, v, k_cache, v_cache, batch, sm_scale, out, window=window)
    return out


def summarize_logits(logits: Tensor, k: int, out: Tensor | None = None,
                     logits_out: Tensor | None = None, use_triton: bool | None = None) -> Tensor:
    """(B, 2 + 2k) float64 greedy id, logprob, top-k ids, logprobs (kernels/logits_summary.py)."""
    if out is None:
        out = torch.empty((logits.shape[0], 2 + 2 * k), dtype=torch.float64,
                          device=logits.device)
    _logits_summary(use_triton, logits, k, out, logits_out)
    return out
