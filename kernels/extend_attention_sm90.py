"""Hopper (sm_90) extend attention for prefix-free batches: inputs, launch shapes, one bound launch
over TMA descriptors (kernel: extend_attention_sm90_kernel.py; reference: extend_attention.py)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.extend_attention_sm90_kernel import BLOCK_M, CONSUMER_REGS, CONSUMERS, HAS_GLUON
from kernels.kv_store import check_store
from kernels.launch import Relauncher
from kernels.varlen import VarlenBatch

if HAS_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels.extend_attention_sm90_kernel import _attention_kernel

__all__ = ["FUSED_STORE_HEAD_DIMS", "HAS_GLUON", "SM90_CONFIG", "SM90_LOOP_CONFIG",
           "SM90_LOOP_Q2_CONFIGS", "Sm90Config", "batch_config", "extend_attention_sm90",
           "pick_sm90", "prepare_sm90", "supported"]


@dataclass(frozen=True)
class Sm90Config:
    """stages: K/V ring depth (3 fill smem at D=128); heads_first: tiles by (head, q-block, seq),
    else (q-block, head, seq); ctas: CTAs looping over tiles, so loads run under another tile's
    softmax (0: one per SM; None: a CTA per tile); q_slots 2: a looping CTA's next Q loads early."""

    stages: int = 3
    heads_first: bool = True
    ctas: int | None = None
    q_slots: int = 1


SM90_CONFIG = Sm90Config()
SM90_LOOP_CONFIG = Sm90Config(ctas=0)
# at D=128 the second Q slot takes the third K/V stage's shared memory
SM90_LOOP_Q2_CONFIGS = {64: Sm90Config(ctas=0, q_slots=2),
                        128: Sm90Config(stages=2, ctas=0, q_slots=2)}
TILE = CONSUMERS * BLOCK_M  # rows of a sequence one tile covers
# Looping CTAs pay their setup once and win where a round spans <= LOOP_MAX_DEPTHS depths; one
# sequence's unequal tiles balance better a CTA per tile. Two Q slots beat a third K/V stage up to
# Q2_MAX_Q_LEN rows. Why each bound: docs/performance.md#attention-kernel-vs-sdpa (pick_sm90).
LOOP_MAX_Q_LEN = 1024
LOOP_MAX_DEPTHS = 3
MIN_Q_LEN = 512
Q2_MAX_Q_LEN = 256
D64_MIN_BLOCKS_PER_SM = 7
# the fused KV store wins at head_dim 64 only (docs/performance.md#attention-kernel-vs-sdpa)
FUSED_STORE_HEAD_DIMS = (64,)


def supported(*xs: torch.Tensor) -> bool:
    """A Hopper GPU, 16-bit (T, heads, D) tensors with D 64/128, TMA-aligned, packed heads."""
    q = xs[0]
    if not (HAS_GLUON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if q.shape[2] not in (64, 128) or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return all(x.dtype == q.dtype and x.data_ptr() % 16 == 0
               and x.stride(0) * x.element_size() % 16 == 0 and x.stride(2) == 1
               and x.stride(1) == x.shape[2] for x in xs)


def _descriptor(x: torch.Tensor, rows: int):
    """x (T, heads, D) with packed heads as a 2-D (T, heads * D) TMA descriptor, [rows, D]."""
    T, heads, D = x.shape
    layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16 if x.dtype ==
                                                  torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, [T, heads * D], [x.stride(0), 1], [rows, D], layout)


def pick_sm90(seqs: int, heads: int, max_q_len: int, sms: int,
              head_dim: int = 128) -> Sm90Config | None:
    """The launch shape for `seqs` sequences of <= max_q_len rows; None where Triton is faster."""
    loops = max_q_len <= LOOP_MAX_Q_LEN and LOOP_MAX_DEPTHS * seqs * heads >= sms
    if head_dim == 64:
        n = -(-max_q_len // TILE)
        blocks = seqs * heads * n * (n + 1) // 2
        return SM90_LOOP_Q2_CONFIGS[64] if loops and blocks >= D64_MIN_BLOCKS_PER_SM * sms else None
    if loops:
        return SM90_LOOP_Q2_CONFIGS[128] if max_q_len <= Q2_MAX_Q_LEN else SM90_LOOP_CONFIG
    return SM90_CONFIG if max_q_len >= MIN_Q_LEN else None


def batch_config(q: torch.Tensor, batch: VarlenBatch) -> Sm90Config | None:
    return pick_sm90(batch.cu_seqlens_q.shape[0] - 1, q.shape[1], batch.max_q_len,
                     _sm_count(q.device), q.shape[2])


def prepare_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch,
                 sm_scale: float | None, out: torch.Tensor, config: Sm90Config | None = None,
                 store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> Relauncher | None:
    """Bind `launch(o)` (None: no work); without num_tokens all T rows are read and must be finite.
    With store (k_cache, v_cache, slots): `launch(o, k_cache, v_cache)` also writes k, v there."""
    T, H, D = q.shape
    KVH = k.shape[1]
    cu, num_tokens = batch.cu_seqlens_q, batch.num_tokens
    B = cu.shape[0] - 1
    assert batch.max_prefix_len == 0, "the Hopper kernel takes prefix-free batches only"
    assert H % KVH == 0 and k.shape == v.shape == (T, KVH, D), "q/k/v shapes"
    assert cu.dtype == torch.int32 and cu.device == q.device, "cu_seqlens_q: int32, q's device"
    assert out.shape == (T, H, D) and out.dtype == q.dtype, "out must be (T, H, D) in q's dtype"
    assert out.stride(2) == 1 and out.stride(1) == D, "out: heads must be packed, contiguous"
    assert supported(q, k, v), "extend_attention_sm90: unsupported inputs (see supported())"
    caches, slots, strides = (out, out), cu, (0, 0)
    if store is not None:
        *caches, slots = store
        check_store(k, v, *caches, slots)
        assert all(x.stride(1) == D for x in caches), "caches: heads must be packed"
        strides = tuple(x.stride(0) for x in caches)
    if B == 0 or batch.max_q_len <= 0 or T == 0 or num_tokens == 0:
        return None
    if num_tokens is not None:
        assert 0 < num_tokens <= T, f"num_tokens {num_tokens} outside (0, {T}]"
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    n_m = -(-batch.max_q_len // TILE)
    n_tiles = H * n_m * B
    if config is None:
        config = batch_config(q, batch) or SM90_CONFIG
    meta = launch_meta(D, config, store is not None)
    span = H * (B if meta["ORDER"] == 2 else n_m)  # tiles of a depth / of a sequence
    args = (_descriptor(q, TILE), _descriptor(k, TILE), _descriptor(v, TILE), out, *caches,
            slots, cu, scale / math.log(2.0), H // KVH, out.stride(0), *strides, H, n_m, B, span,
            n_tiles)
    ctas = n_tiles
    if config.ctas is not None:
        ctas = min(n_tiles, config.ctas or _sm_count(q.device))
    return Relauncher(_attention_kernel, (ctas,), args, meta, (3, 4, 5) if store else (3,))


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_meta(head_dim: int, config: Sm90Config, store_kv: bool = False) -> dict:
    order = 2 if config.ctas is not None else 0 if config.heads_first else 1
    return dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, STAGES=config.stages, Q_SLOTS=config.q_slots,
                STORE_KV=store_kv, CONSUMER_REGS=CONSUMER_REGS, ORDER=order, num_warps=4)


def extend_attention_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch,
                          sm_scale: float | None = None, out: torch.Tensor | None = None,
                          config: Sm90Config | None = None,
                          store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
    """o (T, H, D): prefix-free causal attention on sm_90; with `store`, k and v into the caches."""
    if out is None:
        out = q.new_empty(q.shape)
    launch = prepare_sm90(q, k, v, batch, sm_scale, out, config, store)
    if launch is not None:
        launch(out, *(store[:2] if store is not None else ()))
    return out
