"""The fused small-batch GEMMs (kernels/norm_linear.py) against the chains they replace.

For each model shape and row count: QKV as cuBLAS mm + the folded RoPE kernel vs one
norm_qkv_rope launch, and gate/up as cuBLAS mm + the folded SiLU-and-mul vs one
norm_gate_up_silu launch, each replayed in a CUDA graph (device time per call, so launch gaps
inside the chain count, as they do in a full graph), over a grid of tile sets; also each fused
output's relative error against its chain.

Usage: python bench/norm_linear.py [--models smollm2-135m,llama-3.2-1b] [--rows 16,64,128,256]
Writes norm_linear.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from kernels import activation, rope  # noqa: E402
from kernels.norm_linear import norm_gate_up_silu, norm_qkv_rope  # noqa: E402
from service.model.config import preset  # noqa: E402

EPS = 1e-5
QKV_TILES = [(bm, 0, bk, w, st) for bm, bk, w, st in
             itertools.product((16, 32, 64), (64, 128), (4,), (3, 4))] + [(64, 0, 64, 8, 3)]
MLP_TILES = [(bm, bn, bk, 4, st) for bm, bn, bk, st in
             itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (3,))]


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bench_qkv(cfg, m: int) -> dict:
    d, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n, k = (h + 2 * kvh) * d, cfg.hidden_size
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = (torch.randn(n, device="cuda", dtype=torch.bfloat16) if cfg.qkv_bias else None)
    cs = rope.rope_cos_sin_cache(d, 4096, cfg.rope_theta).cuda()
    pos = torch.arange(m, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def chain():
        torch.mm(x, w.t(), out=out)
        rope.apply_rope(out[:, :h * d].view(m, h, d), out[:, h * d:(h + kvh) * d].view(m, kvh, d),
                        pos, cs, v=out[:, (h + kvh) * d:].view(m, kvh, d), norm_rows=x, eps=EPS,
                        bias=bias)
    chain()
    want = out.clone()
    res = dict(chain=us(chain), fused={})
    for t in QKV_TILES:
        def fused(t=t):
            norm_qkv_rope(x, w, bias, pos, cs, EPS, h, kvh, out, tiles=t)
        fused()
        res["fused"][str(t)] = dict(us=us(fused), relerr=relerr(out, want))
    return res


def bench_mlp(cfg, m: int) -> dict:
    f, k = cfg.intermediate_size, cfg.hidden_size
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(2 * f, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    gu = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)

    def chain():
        torch.mm(x, w.t(), out=gu)
        activation.silu_and_mul(gu, out=gu[:, :f], norm_rows=x, eps=EPS)
    chain()
    want = gu[:, :f].clone()
    res = dict(chain=us(chain), fused={})
    for t in MLP_TILES:
        def fused(t=t):
            norm_gate_up_silu(x, w, EPS, gu[:, :f], tiles=t)
        fused()
        res["fused"][str(t)] = dict(us=us(fused), relerr=relerr(gu[:, :f], want))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--rows", default="16,64,128,256")
    args = ap.parse_args()
    meta = run_meta()
    rows, results = [], []
    for name in args.models.split(","):
        cfg = preset(name)
        for m in map(int, args.rows.split(",")):
            for op, fn in (("qkv+rope", bench_qkv), ("gate_up+silu", bench_mlp)):
                r = fn(cfg, m)
                best = min(r["fused"], key=lambda t: r["fused"][t]["us"])
                default = r["fused"].get(str(DEFAULTS[op](m)))
                results.append(dict(model=name, op=op, rows=m, **r))
                rows.append([name, op, m, round(r["chain"], 2),
                             round(default["us"], 2) if default else None,
                             round(r["fused"][best]["us"], 2), best,
                             f"{r['fused'][best]['relerr']:.1e}"])
                print(rows[-1], flush=True)
    md = ("Device time per call (CUDA-graph replay, µs): the cuBLAS GEMM + folded elementwise "
          "kernel chain, the fused kernel with its default tiles, and the best tile set.\n\n"
          + markdown_table(["model", "op", "rows", "chain µs", "fused default µs",
                            "fused best µs", "best tiles", "relerr"], rows))
    write_results(out_dir(), "norm_linear", meta, {"results": results}, md)
    print(md)


DEFAULTS = {"qkv+rope": lambda m: (min(64, max(16, triton.next_power_of_2(m))), 0, 64, 4, 3),
            "gate_up+silu": lambda m: (min(64, max(16, triton.next_power_of_2(m))), 64, 64, 4, 3)}

if __name__ == "__main__":
    main()
