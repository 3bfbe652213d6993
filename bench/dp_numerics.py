"""How far apart two correct bf16 forwards are: the noise floor a DP parity check must allow.

The data-parallel MLP computes the down projection as a sum of per-rank shards. In bf16 no
sharded sum is bit-identical to the unsharded GEMM, so DP 2 and DP 1 logits differ. This script
measures, on one bf16 model (CPU, SmolLM2-135M shape cut to 3 layers, random weights, 4 prompts
of 9-200 tokens), the logits' relative error and argmax agreement against the plain forward for
  unsharded-fp32  the same unsharded down GEMM, accumulated in fp32 and rounded once (what any
                  other correct GEMM kernel may return): the noise floor
  dp2-bf16        two shards, each rounded to bf16, summed in bf16 (a bf16 reduce-scatter)
  dp2-fp32        two shards summed in fp32, rounded once (an fp32 reduce-scatter)
Usage: python bench/dp_numerics.py   (CPU, ~10 s; prints one line per variant)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import service.model.llama as llama  # noqa: E402
from service.engine.batch import SeqChunk, build_batch  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import random_model  # noqa: E402


def down_proj(mode: str):
    """A replacement for llama._swiglu whose down projection is computed the `mode` way."""
    def swiglu(x, gate_up, down, use_triton, out, scratch):
        act = llama.ops.silu_and_mul(llama.linear(x, gate_up), use_triton=False)
        w, h = down.weight, act.shape[1] // 2
        if mode == "unsharded-fp32":
            y = act.float() @ w.float().t()
        else:
            if mode == "dp2-fp32":
                act, w = act.float(), w.float()
            y = act[:, :h] @ w[:, :h].t() + act[:, h:] @ w[:, h:].t()
        y = y.to(x.dtype)
        return out.copy_(y) if out is not None else y
    return swiglu


def main() -> None:
    torch.manual_seed(0)
    cfg = preset("smollm2-135m", num_layers=3)
    model = random_model(cfg, "cpu", torch.bfloat16, attn_backend="torch")
    pool = KVPool(cfg, 4096, 16, torch.bfloat16, "cpu")
    chunks = [SeqChunk(tuple(torch.randint(0, cfg.vocab_size, (n,)).tolist()), 0,
                       tuple(pool.allocator.alloc(-(-n // 16)))) for n in (30, 9, 50, 200)]
    batch = build_batch(chunks, pool.cache, "cpu")
    plain = llama._swiglu
    with torch.inference_mode():
        ref = model(batch.input_ids, batch.positions, batch.meta).float()
        for mode in ("unsharded-fp32", "dp2-bf16", "dp2-fp32"):
            llama._swiglu = down_proj(mode)
            try:
                got = model(batch.input_ids, batch.positions, batch.meta).float()
            finally:
                llama._swiglu = plain
            rel = ((got - ref).norm() / ref.norm()).item()
            same = bool((got.argmax(-1) == ref.argmax(-1)).all())
            print(f"{mode:15s} logits relerr vs the plain bf16 forward {rel:.2e}, "
                  f"same next token for every prompt: {same}")


if __name__ == "__main__":
    main()
