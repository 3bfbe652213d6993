"""FP8 GEMMs at the service's shapes: which kernel each projection should take.

Per model preset and projection (QKV, O, gate/up, down) and rows (128 .. 8,192), the GPU time
of: bf16 torch.mm (the faster of cuBLAS and cuBLASLt); torch._scaled_mm with row-wise scales
(fp32 sums, and with use_fast_accum); our Triton GEMM with 128 x 128 block scales over a few
tile configs (the best kept, and which; and the one `gemm_config` picks); and the activation
quantization launches (norm + quantize of the projection's input, SiLU-and-
mul + quantize) against the bf16 kernels they replace. Each timing: 20 calls captured in a CUDA
graph, replayed (bench.common.graph_us).

Usage: python bench/fp8_gemm.py [--models llama-3.1-8b,llama-3.2-1b] [--rows 128,...,8192]
Writes fp8_gemm.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, markdown_table, out_dir, run_meta, write_results  # noqa: E402
from kernels import ops  # noqa: E402
from kernels.fp8_gemm import fp8_gemm  # noqa: E402
from kernels.quant_fp8 import E4M3, quantize_ref  # noqa: E402
from service.model.families import preset  # noqa: E402
from service.model.quant.fp8_linear import quantize_blocks  # noqa: E402

CONFIGS = {
    "64x128 w4 s4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4,
                         num_stages=4),
    "128x128 w8 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8,
                          num_stages=4),
    "128x256 w8 s3": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8,
                          num_stages=3),
    "128x64 w4 s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4,
                         num_stages=4),
}


def projections(name: str) -> dict[str, tuple[int, int]]:
    c = preset(name)
    h, f = c.hidden_size, c.intermediate_size
    return {"qkv": (h, c.q_size + 2 * c.kv_size), "o": (c.q_size, h), "gate_up": (h, 2 * f),
            "down": (f, h)}


def bf16_us(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    default = torch.backends.cuda.preferred_blas_library()
    best = float("inf")
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            best = min(best, graph_us(lambda: torch.mm(x, w.t(), out=y)))
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return best


def best_block(a, sa, w, sw, y) -> tuple[float, str]:
    best, which = float("inf"), ""
    for label, cfg in CONFIGS.items():
        try:
            us = graph_us(lambda cfg=cfg: fp8_gemm(a, sa, w, sw, y, config=cfg))
        except Exception as e:  # a config the compiler or the shared memory cannot take
            print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if us < best:
            best, which = us, label
    return best, which


def measure(name: str, rows: list[int]) -> list[dict]:
    out = []
    for proj, (k, n) in projections(name).items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        weights = (w16, *quantize_ref(w16), *quantize_blocks(w16))
        for m in rows:
            r = dict(model=name, proj=proj, m=m, n=n, k=k) | gemm_times(m, *weights)
            print(r, flush=True)
            out.append(r)
    return out


def gemm_times(m: int, w16, wq, sw, wb, swb) -> dict:
    n, k = w16.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa = quantize_ref(x)
    ab, sab = quantize_ref(x, 128)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    r = dict(bf16_us=bf16_us(x, w16, y))
    r["scaled_mm_us"] = graph_us(lambda: torch._scaled_mm(
        a, wq.t(), scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16, out=y))
    r["scaled_mm_fast_us"] = graph_us(lambda: torch._scaled_mm(
        a, wq.t(), scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16, out=y,
        use_fast_accum=True))
    r["block_us"], r["block_cfg"] = best_block(ab, sab, wb, swb, y)
    r["block_default_us"] = graph_us(lambda: fp8_gemm(ab, sab, wb, swb, y))
    # cuBLASLt's block-scaled GEMM takes the activation scales column-major, the weight's
    # transposed (the layout change is left out of its time)
    sab_t, swb_t = sab.t().contiguous().t(), swb.t()
    r["cublas_block_us"] = graph_us(lambda: torch._scaled_mm(
        ab, wb.t(), scale_a=sab_t, scale_b=swb_t, out_dtype=torch.bfloat16, out=y))
    for key in ("bf16", "scaled_mm", "scaled_mm_fast", "block", "block_default", "cublas_block"):
        r[f"{key}_tflops"] = 2 * m * n * k / r[f"{key}_us"] / 1e6
    return r


def quant_rows(name: str, rows: list[int]) -> list[dict]:
    """The launches around the GEMMs at each row count: bf16 add + norm, and add + norm +
    quantize; bf16 SiLU-and-mul, and SiLU-and-mul + quantize; the O input's quantize."""
    out = []
    for m in rows:
        r = dict(model=name, m=m) | launch_times(preset(name), m)
        print(r, flush=True)
        out.append(r)
    return out


def launch_times(c, m: int) -> dict:
    h, f, dev, bf16 = c.hidden_size, c.intermediate_size, "cuda", torch.bfloat16
    x = torch.randn(m, h, device=dev, dtype=bf16)
    res = torch.randn(m, h, device=dev, dtype=bf16)
    w = torch.ones(h, device=dev, dtype=bf16)
    q = torch.empty(m, h, device=dev, dtype=E4M3)
    s = torch.empty(m, device=dev)
    gu = torch.randn(m, 2 * f, device=dev, dtype=bf16)
    qf = torch.empty(m, f, device=dev, dtype=E4M3)
    act = torch.empty(m, f, device=dev, dtype=bf16)
    ao = torch.randn(m, c.q_size, device=dev, dtype=bf16)
    qo = torch.empty(m, c.q_size, device=dev, dtype=E4M3)
    return dict(
        add_norm_us=graph_us(lambda: ops.fused_add_rms_norm(x, res, w, 1e-5)),
        add_norm_quant_us=graph_us(lambda: ops.quantize_fp8(x, q, s, residual=res, weight=w,
                                                            eps=1e-5)),
        act_us=graph_us(lambda: ops.act_and_mul(gu, out=act)),
        act_quant_us=graph_us(lambda: ops.act_and_mul_fp8(gu, qf, s)),
        o_quant_us=graph_us(lambda: ops.quantize_fp8(ao, qo, s)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--rows", default="128,512,1024,2048,4096,8192")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    gemms, quants = [], []
    for name in args.models.split(","):
        gemms += measure(name, rows)
        quants += quant_rows(name, rows)
    table = [[r["model"], r["proj"], r["m"], f"{r['n']}x{r['k']}", r["bf16_tflops"],
              r["scaled_mm_tflops"], r["scaled_mm_fast_tflops"], r["block_tflops"],
              r["block_cfg"], r["block_default_tflops"], r["cublas_block_tflops"],
              r["bf16_us"] / r["scaled_mm_us"]]
             for r in gemms]
    md = ("FP8 GEMM TFLOP/s per projection and rows (N x K: the weight). `scaled_mm`: "
          "torch._scaled_mm, row-wise scales, fp32 sums (what QUANTIZATION=fp8 runs); "
          "`fast-accum`: the same with use_fast_accum; `block`: ours with 128 x 128 scales, "
          "the best of the tile configs listed (which one beside it) and the one gemm_config "
          "picks; `cuBLASLt block`: torch._scaled_mm with the same block scales; "
          "`bf16 / fp8`: bf16 time over scaled_mm's.\n\n"
          + markdown_table(["model", "proj", "rows", "N x K", "bf16", "scaled_mm",
                            "scaled_mm fast-accum", "block best", "block cfg", "block picked",
                            "cuBLASLt block", "bf16 / fp8"], table)
          + "\n\nThe launches around the GEMMs (us):\n\n"
          + markdown_table(["model", "rows", "add + norm (bf16)", "add + norm + quantize",
                            "SiLU-and-mul (bf16)", "SiLU-and-mul + quantize", "O input quantize"],
                           [[r["model"], r["m"], r["add_norm_us"], r["add_norm_quant_us"],
                             r["act_us"], r["act_quant_us"], r["o_quant_us"]] for r in quants]))
    write_results(out_dir(), "fp8_gemm", run_meta(), {"gemms": gemms, "launches": quants}, md)
    print(md)


if __name__ == "__main__":
    main()
