"""The fused norm + linear + epilogue kernel (kernels/norm_linear.py) against the unfused chain
the model runs (Triton add+RMSNorm, cuBLAS GEMM, Triton RoPE or SiLU-and-mul), on the H200.

Per model shape and row count: device microseconds of one layer's QKV part (add + norm, QKV
projection, RoPE) and MLP-input part (add + norm, gate|up projection, SiLU-and-mul), each as
replays of a captured CUDA graph (do_bench_cudagraph: no host launch cost), for several tile
configs of the fused kernel, and the relative error of each against an fp32 chain.

Usage: python bench/norm_linear.py [--rows 128,512,1024]
Writes norm_linear.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, relerr, run_meta, write_results  # noqa: E402
from kernels import ops  # noqa: E402
from kernels.norm_linear import Tiles, norm_linear, norm_linear_ref  # noqa: E402
from kernels.rope import rope_cos_sin_cache  # noqa: E402
from service.model.config import preset  # noqa: E402

MODELS = ["smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b"]
TILES = [Tiles(64, 64, 64, 4, 3), Tiles(64, 32, 64, 4, 4), Tiles(64, 64, 128, 4, 3),
         Tiles(64, 128, 64, 4, 3), Tiles(128, 64, 64, 8, 3), Tiles(64, 32, 128, 4, 3)]


def part(cfg, rows: int, kind: str, gen: torch.Generator) -> dict:
    import triton.testing

    dev, bf = "cuda", torch.bfloat16
    k = cfg.hidden_size
    x = torch.randn(rows, k, generator=gen).to(dev, bf)
    r = torch.randn(rows, k, generator=gen).to(dev, bf)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, bf)
    if kind == "qkv":
        n = cfg.q_size + 2 * cfg.kv_size
        bias = torch.randn(n, generator=gen).to(dev, bf) if cfg.qkv_bias else None
        kw = dict(epilogue="rope", positions=torch.randint(0, 4096, (rows,), device=dev),
                  cos_sin=rope_cos_sin_cache(cfg.head_dim, 4096, cfg.rope_theta,
                                             cfg.rope_scaling).to(dev),
                  rope_cols=cfg.q_size + cfg.kv_size, head_dim=cfg.head_dim)
        out_n = n
    else:
        n = 2 * cfg.intermediate_size
        bias, kw, out_n = None, dict(epilogue="silu"), cfg.intermediate_size
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, bf)
    out = torch.empty(rows, out_n, device=dev, dtype=bf)
    r_out = torch.empty_like(r)
    x2, r2 = x.clone(), r.clone()
    y = torch.empty(rows, n, device=dev, dtype=bf)

    def unfused() -> None:  # the model's chain, on copies (it works in place)
        x2.copy_(x)
        r2.copy_(r)
        ops.fused_add_rms_norm(x2, r2, g, 1e-6)
        torch.addmm(bias, x2, w.t(), out=y) if bias is not None else torch.mm(x2, w.t(), out=y)
        if kind == "qkv":
            t, d = rows, cfg.head_dim
            q = y[:, :cfg.q_size].view(t, cfg.num_heads, d)
            kk = y[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, d)
            ops.apply_rope(q, kk, kw["positions"], kw["cos_sin"])
        else:
            ops.silu_and_mul(y, out=out)

    copies = triton.testing.do_bench_cudagraph(lambda: (x2.copy_(x), r2.copy_(r)), rep=30)
    row = dict(rows=rows, part=kind, unfused_us=(triton.testing.do_bench_cudagraph(
        unfused, rep=50) - copies) * 1e3)
    truth = torch.empty(rows, out_n, device=dev, dtype=torch.float32)
    norm_linear_ref(x.float(), r.float(), torch.empty_like(r, dtype=torch.float32), g.float(),
                    1e-6, w.float(), bias.float() if bias is not None else None, truth, **kw)
    unfused()
    row["unfused_err"] = relerr(y if kind == "qkv" else out, truth)
    for t in TILES:
        name = f"{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"

        def fused(t=t) -> None:
            norm_linear(x, r, r_out, g, 1e-6, w, bias, out, tiles=t, **kw)

        fused()
        torch.cuda.synchronize()
        row[f"{name}_err"] = relerr(out, truth)
        row[f"{name}_us"] = triton.testing.do_bench_cudagraph(fused, rep=50) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,512,1024")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    meta = run_meta()
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.models.split(","):
        cfg = preset(name)
        for rows in map(int, args.rows.split(",")):
            for kind in ("qkv", "mlp"):
                row = dict(model=name, **part(cfg, rows, kind, gen))
                results.append(row)
                print(row, flush=True)
    names = [f"{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}" for t in TILES]
    md = markdown_table(
        ["model", "rows", "part", "unfused us"] + [f"{n} us" for n in names]
        + ["unfused err", "worst fused err"],
        [[r["model"], r["rows"], r["part"], r["unfused_us"]] + [r[f"{n}_us"] for n in names]
         + [r["unfused_err"], max(r[f"{n}_err"] for n in names)] for r in results])
    write_results(out_dir(), "norm_linear", meta, {"rows": results}, md)
    print(md)


if __name__ == "__main__":
    main()
