"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) in plain PyTorch over a flat varlen batch.

forward(input_ids (T,), positions (T,), meta) -> logits of the rows in meta.logits_indices.
Each layer is split at its attention *break* (`pre` → attention → `post`) so the graph runner
can capture the dense parts and run attention eagerly; `forward` is the same chain, eager.
The dense methods take optional `out`/`scratch` buffers: the graph runner passes slices of its
static buffers so that a captured segment allocates nothing; eager calls allocate as usual and
run the very same kernels (so graph replay and eager agree bit for bit on the same rows, except
where the runner's MLP runs in row chunks: smaller matmuls that the BLAS may tile differently).

Folded norms (`LlamaModel.fold_norms`, the engine's default for bf16/fp32): rms_norm(x) @ W^T
= rstd(x) * (x @ (W * g)^T) per row, so each layer's two norm weights g are multiplied into
the QKV and gate/up weights once (the norms keep unit weights). Batches whose residual stream
is small (`fuses_norm`) then drop the norm kernels: the residual holds the whole hidden state,
the o and down projections add into it in the GEMM (addmm with beta 1), QKV and gate/up read
it un-normalized, and the per-row rstd moves into the kernels after them, RoPE and
SiLU-and-mul, which read the row for it: seven kernels per layer instead of nine. `h` is None
in that structure (the residual is the whole state). Larger batches keep the norm kernels
(with unit weights: the same math): there the beta-1 GEMMs and the extra row reads cost more
than the norms they replace. Not for fp16 (the un-normalized projections of large residual
rows can leave fp16's range) nor with data parallelism (its MLP gathers normed rows).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.rope import rope_cos_sin_cache
from service.model.attention import AttentionBackend
from service.model.config import ModelConfig
from service.model.meta import ForwardMeta


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_triton = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        """rms_norm(x) (into `out`), or with `residual`: in place, returns (x, residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, out=out, use_triton=self.use_triton)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps,
                                      use_triton=self.use_triton)


def linear(x: torch.Tensor, lin: nn.Linear, out: torch.Tensor | None = None, *,
           accumulate: bool = False, bias: bool = True) -> torch.Tensor:
    """`lin(x)`, optionally into `out`: the same mm/addmm F.linear runs, without an allocation.
    `accumulate`: out += x @ W^T in the GEMM (no bias); `bias=False` leaves the bias out.
    `lin` may also be a layer-indexed stand-in (service.model.stacked.IndexedLinear)."""
    if not isinstance(lin, nn.Linear):
        return lin(x, out, accumulate=accumulate, bias=bias)
    if accumulate:
        assert out is not None and lin.bias is None, "accumulate into an out, without a bias"
        return out.addmm_(x, lin.weight.t())
    b = lin.bias if bias else None
    if out is None:
        return torch.nn.functional.linear(x, lin.weight, b)
    if b is None:
        return torch.mm(x, lin.weight.t(), out=out)
    return torch.addmm(b, x, lin.weight.t(), out=out)


def bias_of(lin) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(bias, layer, offset) of a projection: a plain bias with no layer, or a layer-indexed
    stand-in's (L, N) bias stack with its device layer counter."""
    if isinstance(lin, nn.Linear):
        return lin.bias, None, 0
    return lin.bias, (lin.layer if lin.bias is not None else None), lin.offset


# Largest residual stream (rows x hidden elements, 12 MiB in bf16) whose batches run without
# norm kernels once the norms are folded. Interleaved A/B on the H200 (bench/fold_ab.py,
# bench/results/fold-ab-s9-*): SmolLM2-135M (576 wide) gained 2.5-10 % at 128 to 8,192 rows;
# Llama-3.2-1B (2,048 wide) gained 2-4 % at 128 rows, broke even at 1,024 and lost 3.5 % on
# one 8,192-token prompt (its beta-1 GEMMs and the extra row reads outweigh the norm kernels
# once the GEMMs are large).
FUSED_NORM_MAX_ELEMS = 6 << 20

MLP_ROW_ALIGN = 16  # MLP row chunks are multiples of this: whole GEMM row tiles


def mlp_row_chunks(rows: int, cap: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of at most `cap` rows: k = ceil(rows / cap) chunks of ceil(rows / k)
    rows rounded up to MLP_ROW_ALIGN (but at most `cap`), the last one taking the rest."""
    assert rows > 0 and cap > 0, f"{rows} rows in chunks of at most {cap}"
    k = -(-rows // cap)
    if k == 1:
        return [(0, rows)]
    even = -(-rows // k)
    size = min(cap, -(-even // MLP_ROW_ALIGN) * MLP_ROW_ALIGN)
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def swiglu(x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, use_triton: bool,
           out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
           norm_eps: float | None = None) -> torch.Tensor:
    """down(silu(gate) * up); `scratch` (≤T, 2F) holds gate|up, then the activation in place.

    `norm_eps` (folded norms): x is the residual stream and gate_up's weight has the norm
    weight folded in; the activation scales by each row's rstd, and down adds into `out`,
    which must be x itself (x <- x + mlp(norm(x))).

    With fewer scratch rows than x has, runs in row chunks of nearly equal size (multiples of
    MLP_ROW_ALIGN, so no chunk is a sliver with a mostly empty GEMM tile) that fit in it: the graph
    runner's arena is sized for attention, not for 2F-wide rows. The chunk shapes depend on
    the row count only, so a captured bucket replays the same loop.
    """
    rows = x.shape[0]
    assert norm_eps is None or out is x, "a folded-norm MLP adds into the residual it reads"
    if scratch is None or scratch.shape[0] >= rows:
        return _swiglu(x, gate_up, down, use_triton, out,
                       None if scratch is None else scratch[:rows], norm_eps)
    if out is None:
        out = x.new_empty(rows, down.out_features)
    # NOTE: the runner passes the same buffer as x and out (hidden). Chunk [lo, hi) reads
    # x[lo:hi] (all of it, in the gate_up matmul) before writing out[lo:hi], and no chunk
    # touches another's rows, so reading rows that an earlier chunk overwrote cannot happen.
    for lo, hi in mlp_row_chunks(rows, scratch.shape[0]):
        _swiglu(x[lo:hi], gate_up, down, use_triton, out[lo:hi], scratch[: hi - lo], norm_eps)
    return out


def _swiglu(x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, use_triton: bool,
            out: torch.Tensor | None, scratch: torch.Tensor | None,
            norm_eps: float | None = None) -> torch.Tensor:
    gu = linear(x, gate_up, scratch)  # (T, 2F)
    f = gu.shape[1] // 2
    folded = norm_eps is not None
    # NOTE: in place into gu's gate half (row stride 2F): each element of the gate half is read
    # by the one program that writes it, so this is safe and saves a (T, F) tensor.
    act = ops.silu_and_mul(gu, out=gu[:, :f], use_triton=use_triton,  # (T, F), strided rows
                           norm_rows=x if folded else None, eps=norm_eps or 0.0)
    return linear(act, down, out, accumulate=folded)  # (T, hidden)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.use_triton = False

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, dp=None,
                norm_eps: float | None = None) -> torch.Tensor:
        assert dp is None, "a data-parallel forward needs the sharded MLP (service.engine.dp)"
        return swiglu(x, self.gate_up_proj, self.down_proj, self.use_triton, out, scratch,
                      norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.use_triton = False
        self.folded = False  # the norm weights live in qkv_proj / gate_up_proj (fold_norms)

    def fold_norms(self) -> None:
        """Multiply the input norm's weight into qkv_proj's and the post-attention norm's into
        gate_up_proj's input columns (in fp32, rounded once), in place; the norms keep unit
        weights, for the batches too large to skip them (`fuses_norm`)."""
        for norm, lin in ((self.input_layernorm, self.qkv_proj),
                          (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            w = lin.weight.data
            w.copy_(w.float().mul_(norm.weight.data.float()[None, :]).to(w.dtype))
            norm.weight.data.fill_(1.0)  # the norm kernels, where they still run, only scale
        self.folded = True

    def fuses_norm(self, rows: int) -> bool:
        """Whether a batch of `rows` runs this layer without norm kernels (folded weights and a
        residual of at most FUSED_NORM_MAX_ELEMS)."""
        return self.folded and rows * self.cfg.hidden_size <= FUSED_NORM_MAX_ELEMS

    def pre(self, h: torch.Tensor | None, residual: torch.Tensor | None,
            positions: torch.Tensor, cos_sin: torch.Tensor, qkv_out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add + norm (in place), QKV projection, RoPE. Returns (qkv, residual).
        Folded: the residual (or, first, h) is the whole state and the norm rides on RoPE."""
        if self.fuses_norm((residual if residual is not None else h).shape[0]):
            assert h is None or residual is None, "without norm kernels h is folded in already"
            x = residual if residual is not None else h
            return self.qkv_rope(x, positions, cos_sin, qkv_out, norm_rows=x), x
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.qkv_rope(h, positions, cos_sin, qkv_out), residual

    def qkv_rope(self, h_normed: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 out: torch.Tensor | None = None, norm_rows: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """QKV projection and RoPE; with `norm_rows` (folded norms: h_normed is then the raw
        residual) RoPE also scales q, k, v by the rows' rstd and adds the bias."""
        folded = norm_rows is not None
        qkv = linear(h_normed, self.qkv_proj, out, bias=not folded)  # (T, (H + 2KVH) * D)
        t, c = qkv.shape[0], self.cfg
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        if not folded:
            ops.apply_rope(q, k, positions, cos_sin, use_triton=self.use_triton)
            return qkv
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        bias, layer, offset = bias_of(self.qkv_proj)
        ops.apply_rope(q, k, positions, cos_sin, use_triton=self.use_triton, v=v,
                       norm_rows=norm_rows, eps=c.rms_norm_eps, bias=bias, layer=layer,
                       offset=offset)
        return qkv

    def post(self, attn_out: torch.Tensor, residual: torch.Tensor,
             h_out: torch.Tensor | None = None, scratch: torch.Tensor | None = None, dp=None
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Output projection, residual add + norm, MLP. Returns (h, residual).

        With `h_out`, the projection, the norm and the MLP output all live in `h_out`.
        Folded: both projections add into `residual` (h_out unused); returns (None, residual).
        """
        if self.fuses_norm(residual.shape[0]):
            assert dp is None, "folded norms do not serve the data-parallel MLP"
            linear(attn_out, self.o_proj, residual, accumulate=True)
            self.mlp(residual, out=residual, scratch=scratch, norm_eps=self.cfg.rms_norm_eps)
            return None, residual
        h = linear(attn_out, self.o_proj, h_out)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, out=h_out, scratch=scratch, dp=dp), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: str = "torch",
                 max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.attn = AttentionBackend(attn_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.max_positions = max_positions or cfg.max_position_embeddings
        # fp32 (max_pos, D): cos | sin, Llama-3 scaling baked in; not a parameter.
        self.register_buffer("cos_sin", self.rope_table(cfg, self.max_positions), persistent=False)
        self.norms_folded = False

    @staticmethod
    def rope_table(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
        return rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def fold_norms(self) -> None:
        """Fold every layer's two norm weights into its projections (see the module note);
        idempotent. The weights then differ from the checkpoint's: fold after loading."""
        if self.norms_folded:
            return
        with torch.no_grad():
            for layer in self.layers:
                layer.fold_norms()
        self.norms_folded = True

    def fuses_norm(self, rows: int) -> bool:
        """Whether a batch of `rows` runs without norm kernels (DecoderLayer.fuses_norm)."""
        return len(self.layers) > 0 and self.layers[0].fuses_norm(rows)

    def set_kernels(self, use_triton: bool) -> None:
        """Dense ops (norms, RoPE, SiLU-and-mul) on Triton kernels or their references."""
        for m in self.modules():
            if hasattr(m, "use_triton"):
                m.use_triton = use_triton

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.embed_tokens(input_ids)  # (T, hidden)
        return torch.index_select(self.embed_tokens.weight, 0, input_ids, out=out)

    def final_norm(self, h: torch.Tensor | None, residual: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """norm(h + residual) (in place in h, `out` unused), or with h None (folded norms: the
        residual is the whole state) norm(residual), into `out` if given."""
        if h is None:
            return self.norm(residual, out=out)
        h, _ = self.norm(h, residual)
        return h

    def logits(self, h_normed: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """LM head on the selected rows only, fp32 logits (N, vocab)."""
        return self.logits_at(h_normed, meta.logits_indices)

    def logits_at(self, h_normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """LM head on h_normed[rows], fp32 logits (len(rows), vocab)."""
        return self.head_at(h_normed, rows).float()

    def head_at(self, h_normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """LM head on h_normed[rows], in the model's dtype (len(rows), vocab)."""
        picked = h_normed.index_select(0, rows)  # (N, hidden)
        return torch.nn.functional.linear(picked, self.head_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: ForwardMeta, dp=None) -> torch.Tensor:
        """Eager forward. `dp` (service.engine.dp.DPTokens): this rank's share of a
        data-parallel step, whose MLPs gather every rank's tokens (the model must be sharded)."""
        h = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            qkv, residual = layer.pre(h, residual, positions, self.cos_sin)
            attn_out = self.attn(layer.layer_id, qkv, meta)
            h, residual = layer.post(attn_out, residual, dp=dp)
        return self.logits(self.final_norm(h, residual), meta)
