"""The decoder every family runs over a flat varlen batch: Llama's layer plus the differences a
family declares in its ModelConfig; `run(acts, steps)` is the one forward every path executes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.rope import rope_cos_sin_cache
from service.model.attention import AttentionBackend
from service.model.config import ModelConfig
from service.model.heads import ScoreHead
from service.model.layers import MLP, RMSNorm
from service.model.meta import ForwardMeta
from service.model.quant import PROJECTIONS, Projection, Rows, Scratch
from service.model.quant.plain import SCHEME as PLAIN
from service.model.quant.plain import Linear

# Largest residual stream (rows x hidden elements) that runs without norm kernels when folded
FUSED_NORM_MAX_ELEMS = 6 << 20


@dataclass(frozen=True)
class Activations:
    """What one forward reads and writes, n rows each: fresh tensors, or static graph views."""

    input_ids: torch.Tensor  # (n,) int64
    positions: torch.Tensor  # (n,) int64
    residual: torch.Tensor  # (n, D)
    hidden: torch.Tensor  # (n, D): MLP output, normed QKV input, the final normed rows
    qkv: torch.Tensor  # (n, q + 2kv): into attention
    attn: torch.Tensor  # (n, q): out of attention
    # (<= n, 2F) gate|up rows; fewer than n: the MLP runs in row chunks; None: allocated
    mlp_scratch: torch.Tensor | None = None
    # the projections' inputs as their scheme stores them: QKV, O and gate|up (n rows); down
    # (an MLP chunk's); None: plain inputs, or allocated per call
    qin: Scratch | None = None
    qin_mlp: Scratch | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, input_ids: torch.Tensor, positions: torch.Tensor,
              dtype: torch.dtype) -> Activations:
        n, kw = input_ids.shape[0], dict(dtype=dtype, device=input_ids.device)
        return cls(input_ids, positions, torch.empty(n, cfg.hidden_size, **kw),
                   torch.empty(n, cfg.hidden_size, **kw),
                   torch.empty(n, cfg.q_size + 2 * cfg.kv_size, **kw),
                   torch.empty(n, cfg.q_size, **kw))


class Steps(Protocol):
    def dense(self, fn: Callable[[], None]) -> None: ...
    def attention(self, layer: int) -> None: ...


class Eager:
    def __init__(self, attend: Callable[[int], None]):
        self.attention = attend

    @staticmethod
    def dense(fn: Callable[[], None]) -> None:
        fn()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(h, eps)
        self.qkv_proj = Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps) if cfg.qk_norm else None
        self.o_proj = Linear(cfg.q_size, h, bias=False)
        self.attn_out_norm = RMSNorm(h, eps) if cfg.sandwich_norms else None
        self.mlp_norm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.activation)
        self.mlp_out_norm = RMSNorm(h, eps) if cfg.sandwich_norms else None
        # the model's RoPE table this layer reads: 1 for windowed layers with their own base
        self.rope = int(bool(cfg.window(layer_id)) and cfg.local_rope_theta is not None)
        self.use_triton = False
        self.folded = False  # the norm weights live in qkv_proj / gate_up_proj (fold_norms)

    def fold_norms(self) -> None:
        """Norm weights into the next projections; forwards up to FUSED_NORM_MAX_ELEMS skip norms.
        NOTE: sandwich norms do not fold: a branch output is normed before the residual add."""
        self.fold_norm_weights()
        self.folded = True

    def fold_norm_weights(self) -> None:
        """The weights' half of `fold_norms`: the norms still run, with unit weights."""
        assert not self.cfg.sandwich_norms, "sandwich-norm layers keep their norm kernels"
        for norm, lin in ((self.attn_norm, self.qkv_proj), (self.mlp_norm, self.mlp.gate_up_proj)):
            lin.fold_norm(norm.weight.data)
            norm.weight.data.fill_(1.0)

    def fuses_norm(self, rows: int) -> bool:
        return self.folded and rows * self.cfg.hidden_size <= FUSED_NORM_MAX_ELEMS

    def pre(self, h: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
            cos_sin: torch.Tensor, qkv_out: torch.Tensor, qin: Scratch | None = None) -> None:
        """Residual add + norm, QKV and RoPE into `qkv_out`; h is None when the norm is fused."""
        if self.fuses_norm(residual.shape[0]):
            self.qkv_rope(residual, positions, cos_sin, qkv_out, norm_rows=residual)
            return
        x = self.qkv_proj.normed(self.attn_norm, h, residual, scratch=qin)
        self.qkv_rope(x, positions, cos_sin, qkv_out)

    def qkv_rope(self, h_normed: Rows, positions: torch.Tensor,
                 cos_sin: torch.Tensor, out: torch.Tensor | None = None,
                 norm_rows: torch.Tensor | None = None) -> torch.Tensor:
        """QKV, QK-norm and RoPE; with `norm_rows` the RoPE kernel also applies norm and bias."""
        folded = norm_rows is not None
        qkv = self.qkv_proj.matmul(h_normed, out, bias=not folded)  # (T, (H + 2KVH) * D)
        t, c = qkv.shape[0], self.cfg
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        qk = {} if self.q_norm is None else dict(
            q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, qk_eps=c.rms_norm_eps)
        if not folded:
            ops.apply_rope(q, k, positions, cos_sin, use_triton=self.use_triton, **qk)
            return qkv
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        ops.apply_rope(q, k, positions, cos_sin, use_triton=self.use_triton, v=v,
                       norm_rows=norm_rows, eps=c.rms_norm_eps, bias=self.qkv_proj.bias, **qk)
        return qkv

    def post(self, attn_out: torch.Tensor, residual: torch.Tensor, h_out: torch.Tensor,
             scratch: torch.Tensor | None = None, qin: Scratch | None = None,
             qin_mlp: Scratch | None = None) -> torch.Tensor | None:
        """O projection, add + norm, MLP into `h_out`; fused norm: into `residual`, returns None."""
        if self.fuses_norm(residual.shape[0]):
            self.o_proj.matmul(attn_out, residual, accumulate=True)
            self.mlp(residual, out=residual, scratch=scratch, norm_eps=self.cfg.rms_norm_eps)
            return None
        h = self.o_proj.matmul(attn_out, h_out, scratch=qin)
        if self.attn_out_norm is not None:
            self.attn_out_norm(h, out=h)
        x = self.mlp.gate_up_proj.normed(self.mlp_norm, h, residual, scratch=qin)
        h = self.mlp(x, out=h, scratch=scratch, qin=qin_mlp)
        if self.mlp_out_norm is not None:
            self.mlp_out_norm(h, out=h)
        return h


class DecoderModel(nn.Module):
    """What the engine sees of a model: `run`, its heads, dims, attention seam and `scheme`."""

    def __init__(self, cfg: ModelConfig, attn_backend: str = "torch",
                 max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.attn = AttentionBackend(attn_backend, cfg)
        self.max_positions = max_positions or cfg.max_position_embeddings
        # fp32 (max_pos, D): cos | sin, scaling baked in; not parameters. [1]: windowed layers'
        self.register_buffer("cos_sin", self.rope_table(cfg, self.max_positions), persistent=False)
        if cfg.local_rope_theta is not None:
            self.register_buffer("cos_sin_local", self.rope_table(cfg, self.max_positions, True),
                                 persistent=False)
        self.norms_folded = False
        self.scheme = PLAIN  # the projections' (service/model/quant/): set as they change
        self.score_head: ScoreHead | None = None  # SCORE_HEAD's (service/model/heads.py)

    @staticmethod
    def rope_table(cfg: ModelConfig, max_positions: int, local: bool = False) -> torch.Tensor:
        if local:
            return rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.local_rope_theta)
        return rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def build_rope_tables(self, device: torch.device) -> None:
        """(Re)compute the RoPE tables on `device` (to_empty() leaves buffers uninitialised)."""
        self.cos_sin = self.rope_table(self.cfg, self.max_positions).to(device)
        if self.cfg.local_rope_theta is not None:
            self.cos_sin_local = self.rope_table(self.cfg, self.max_positions, True).to(device)

    def _table(self, layer: int) -> torch.Tensor:
        return self.cos_sin_local if self.layers[layer].rope else self.cos_sin

    def fold_norms(self) -> None:
        """Fold every layer's norms, unless sandwich or into projections that cannot take them."""
        if (self.norms_folded or self.cfg.sandwich_norms
                or not all(p.foldable for p in self.projections())):
            return
        with torch.no_grad():
            for layer in self.layers:
                layer.fold_norms()
        self.norms_folded = True

    def fuses_norm(self, rows: int) -> bool:
        return len(self.layers) > 0 and self.layers[0].fuses_norm(rows)

    @property
    def quantized(self) -> bool:
        return self.scheme.name != "none"

    def projections(self) -> list[Projection]:
        return [layer.get_submodule(p) for layer in self.layers for p in PROJECTIONS]

    def set_kernels(self, use_triton: bool) -> None:
        for m in self.modules():
            if hasattr(m, "use_triton"):
                m.use_triton = use_triton

    def map_mlps(self, fn: Callable[[nn.Module], nn.Module]) -> None:
        """Replace every layer's MLP by fn(mlp) (the data-parallel runner shards them)."""
        for layer in self.layers:
            layer.mlp = fn(layer.mlp)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def mlp_width(self) -> int:
        """Gate|up output features: the MLP scratch's row width."""
        return 2 * self.cfg.intermediate_size

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def embed_scale(self) -> float:
        """The embedding multiplier as the checkpoint's dtype holds it (Gemma: √hidden)."""
        return float(torch.tensor(self.cfg.embed_scale, dtype=self.dtype))

    def run(self, acts: Activations, steps: Steps) -> None:
        """Token ids to the final normed rows (acts.hidden); attention reads qkv, writes attn."""
        steps.dense(functools.partial(self._begin, acts))
        for i in range(len(self.layers)):
            steps.attention(i)
            steps.dense(functools.partial(self._between, i, acts))

    def _begin(self, a: Activations) -> None:
        torch.index_select(self.embed_tokens.weight, 0, a.input_ids, out=a.residual)
        if self.cfg.embed_scale != 1.0:
            a.residual.mul_(self.embed_scale)
        if self.layers:
            first = self.layers[0]
            if not first.fuses_norm(a.residual.shape[0]):
                x = first.qkv_proj.normed(first.attn_norm, a.residual, out=a.hidden,
                                          scratch=a.qin)
                first.qkv_rope(x, a.positions, self._table(0), out=a.qkv)
                return
            first.pre(None, a.residual, a.positions, self._table(0), a.qkv)

    def _between(self, i: int, a: Activations) -> None:
        """Layer i after its attention, then layer i + 1 up to its attention (or the final norm)."""
        h = self.layers[i].post(a.attn, a.residual, a.hidden, a.mlp_scratch, a.qin, a.qin_mlp)
        if i + 1 < len(self.layers):
            self.layers[i + 1].pre(h, a.residual, a.positions, self._table(i + 1), a.qkv, a.qin)
        elif h is None:  # no norm kernels: the residual is the whole state
            self.norm(a.residual, out=a.hidden)
        else:
            self.norm(h, a.residual)

    def logits(self, h_normed: torch.Tensor, meta: ForwardMeta,
               picked: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_at(h_normed, meta.logits_indices, picked).float()

    def head_at(self, h_normed: torch.Tensor, rows: torch.Tensor,
                picked: torch.Tensor | None = None) -> torch.Tensor:
        """LM head of `rows`; `picked` (N, hidden), if given, keeps the normed rows it reads."""
        picked = torch.index_select(h_normed, 0, rows, out=picked)  # (N, hidden)
        logits = torch.nn.functional.linear(picked, self.head_weight)
        cap = self.cfg.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits.float() / cap).mul_(cap)

    def score(self, picked: torch.Tensor) -> torch.Tensor:
        """The score head's fp32 logits (n, labels) of final-norm rows (n, hidden)."""
        return torch.nn.functional.linear(picked.float(), self.score_head.weight)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: ForwardMeta) -> torch.Tensor:
        """Every row's final-norm hidden state (T, D)."""
        acts = Activations.empty(self.cfg, input_ids, positions, self.dtype)
        self.run(acts, Eager(lambda i: self.attn(i, acts.qkv, meta, out=acts.attn)))
        return acts.hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                picked: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, meta), meta, picked)
