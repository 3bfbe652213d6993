"""Does torch.compile make a dense segment faster inside a captured CUDA graph?

The dense segment between two attention breaks at small batches, as the service runs it with
folded norms (service.model.llama): the o projection added into the residual in the GEMM,
gate/up, SiLU-and-mul scaled by each row's rstd, the down projection added into the residual,
QKV, then RoPE scaled by the rstd (plus the bias for Qwen2). Each variant below is captured
--reps times in one CUDA graph and replayed (bench.common.graph_us); the figure is GPU
microseconds per segment:

  ours        DecoderLayer.post + the next layer's pre on the Triton kernels (what the graphs hold)
  math        the same math in plain PyTorch (`segment_math`), not compiled (a reference)
  inductor    `segment_math` through torch.compile (mode "default": cuBLAS for the GEMMs,
              generated Triton for the rest)
  autotune    torch.compile mode "max-autotune-no-cudagraphs" (Triton GEMM templates tried
              against cuBLAS, pointwise epilogues fused into them where they fit)

Compiled code is captured by our own graph (inductor's cudagraphs stay off, as they would have
to inside the runner's capture). Each variant's outputs are checked against ours (relerr).

Usage: python bench/compile_segment.py [--models smollm2-135m,llama-3.2-1b] [--rows 128,1024]
       [--modes default,max-autotune-no-cudagraphs]
Writes compile_segment.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, markdown_table, out_dir, relerr, run_meta, write_results  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import random_model  # noqa: E402


def segment_math(attn, residual, positions, wo, wgu, wd, wqkv, bqkv, cos_sin, eps: float,
                 heads: int, kv_heads: int, head_dim: int):
    """post(i) + pre(i + 1) with folded norms, functional: (new residual, qkv after RoPE)."""
    residual = torch.addmm(residual, attn, wo.t())
    f = wd.shape[1]
    gu = residual @ wgu.t()
    rstd = torch.rsqrt(residual.float().square().mean(-1, keepdim=True) + eps)
    act = (F.silu(gu[:, :f].float() * rstd) * (gu[:, f:].float() * rstd)).to(residual.dtype)
    residual = torch.addmm(residual, act, wd.t())
    rstd = torch.rsqrt(residual.float().square().mean(-1, keepdim=True) + eps)
    qkv = (residual @ wqkv.t()).float() * rstd
    if bqkv is not None:
        qkv = qkv + bqkv.float()
    t, half = qkv.shape[0], head_dim // 2
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :]
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(t, -1)

    return residual, torch.cat([rotate(q), rotate(k), v], -1).to(residual.dtype)


def case(name: str, rows: int, modes: list[str], reps: int, device: str = "cuda") -> list[dict]:
    cfg = preset(name)
    model = random_model(cfg, device, torch.bfloat16, seed=0)
    model.fold_norms()
    model.set_kernels(device == "cuda")
    lay, nxt = model.layers[0], model.layers[1]
    assert lay.fuses_norm(rows), "this bench times the folded-norm segment"
    g = torch.Generator(device="cuda").manual_seed(1)
    attn0 = torch.randn(rows, cfg.q_size, device="cuda", dtype=torch.bfloat16, generator=g)
    res0 = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.arange(rows, device="cuda")
    cos_sin = model.cos_sin.to("cuda")
    residual, qkv = res0.clone(), torch.empty(rows, cfg.q_size + 2 * cfg.kv_size,
                                              device="cuda", dtype=torch.bfloat16)
    scratch = torch.empty(rows, 2 * cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)

    def ours():  # what a captured segment runs: in place into the residual and the qkv buffer
        h, _ = lay.post(attn0, residual, scratch=scratch)
        nxt.pre(h, residual, positions, cos_sin, qkv_out=qkv)

    with torch.inference_mode():
        ours()  # from res0: the reference outputs (timed calls then keep adding into it)
        want_res, want_qkv = residual.clone(), qkv.clone()
        args = (attn0, res0, positions, lay.o_proj.weight, lay.mlp.gate_up_proj.weight,
                lay.mlp.down_proj.weight, nxt.qkv_proj.weight, nxt.qkv_proj.bias, cos_sin,
                cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        out = [dict(model=name, rows=rows, variant="ours", us=graph_us(ours, reps),
                    compile_s=0.0, relerr=0.0)]
        fns = {"math": segment_math}
        for mode in modes:
            fns["inductor" if mode == "default" else "autotune"] = torch.compile(
                segment_math, mode=mode, fullgraph=True, dynamic=False)
        for label, fn in fns.items():
            t0 = time.perf_counter()
            try:
                got_res, got_qkv = fn(*args)  # compiles here
                torch.cuda.synchronize()
                took = time.perf_counter() - t0
                err = max(relerr(got_res, want_res), relerr(got_qkv, want_qkv))
                us = graph_us(lambda fn=fn: fn(*args), reps)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
                print(name, rows, label, "failed:", repr(e)[:300], flush=True)
                out.append(dict(model=name, rows=rows, variant=label, us=None, compile_s=None,
                                relerr=None, error=repr(e)[:300]))
                continue
            out.append(dict(model=name, rows=rows, variant=label, us=us,
                            compile_s=round(took, 1), relerr=err))
            print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--rows", default="128,1024")
    ap.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    meta = run_meta()
    rows: list[dict] = []
    shapes = [(m, int(n)) for m in args.models.split(",") for n in args.rows.split(",")]
    for name, n in shapes:
        rows += case(name, n, args.modes.split(","), args.reps)
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limits
        write(meta, rows)  # after every shape: a run cut short keeps what it measured


def write(meta: dict, rows: list[dict]) -> None:
    base = {(r["model"], r["rows"]): r["us"] for r in rows if r["variant"] == "ours"}
    md = ("GPU us per dense segment (post + next pre, folded norms), captured in a CUDA graph; "
          "`vs ours` > 1 is slower than the service's kernels.\n\n"
          + markdown_table(
              ["model", "rows", "variant", "us", "vs ours", "compile s", "relerr"],
              [[r["model"], r["rows"], r["variant"], r["us"],
                None if r["us"] is None else round(r["us"] / base[r["model"], r["rows"]], 3),
                r["compile_s"], r["relerr"]] for r in rows]))
    write_results(out_dir(), "compile_segment", meta, {"rows": rows}, md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
