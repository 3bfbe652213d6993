"""A lower bound on an 8,192-token prefill from the fastest kernels at hand, next to transformers.

For each model and batch shape (prompts x tokens = 8,192): the GPU time of each layer's four
projections (QKV, O, gate/up, down) at 8,192 rows, the faster of cuBLAS and cuBLASLt, plus its
causal attention, the fastest of our kernel and SDPA's flash, cuDNN and efficient backends
(equal-length prompts, so SDPA takes the batch as one (B, H, S, D) call), times the layer count.
Everything else a forward needs (embedding, norms, RoPE, SiLU, KV store, LM head, host work)
is left out, so no implementation on this GPU with these kernels prefills faster than
8,192 / bound tokens/s. In the same run: transformers (sdpa, bf16, as bench/e2e.py runs it)
and, unless --skip-ours, our service path (ours-graph), so the ratio a target asks for can be
set against the bound.

Each kernel is captured 20 times in a CUDA graph and replayed (bench.common.graph_us).

With --breakdown, one profiled forward of ours per shape splits its time: GEMM, attention and
other kernels, and the rest of the wall time (gaps between kernels, host work before the first
kernel and after the last), so what separates ours from the bound is measured, not guessed.

Windowed layers (Gemma 3's local layers) count the faster of our windowed kernel and the best
causal attention.

With --fp8 the projections count the FP8 GEMM with row-wise scales and fp32 sums
(torch._scaled_mm: the scheme QUANTIZATION=fp8 serves) instead of bf16, the bf16 bound stays
beside it, and ours runs with QUANTIZATION=fp8 (ours-graph-fp8).

Usage: python bench/bound.py [--models qwen2.5-0.5b,smollm2-135m,llama-3.2-1b] [--skip-ours]
                             [--breakdown] [--fp8]
Writes bound.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import flops, gemm_ceiling, hf_model, run_hf, run_ours  # noqa: E402
from kernels import extend_attention_sm90 as sm90  # noqa: E402
from kernels.extend_attention import VarlenBatch, extend_attention  # noqa: E402
from kernels.quant_fp8 import quantize_ref  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.families import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402
from service.model.weights import load_hf_state  # noqa: E402

SHAPES = ((8, 1024), (64, 128), (1, 8192))
ROWS = 8192
SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) per projection."""
    h, f = c.hidden_size, c.intermediate_size
    return {"qkv": (h, c.q_size + 2 * c.kv_size), "o": (c.q_size, h), "gate_up": (h, 2 * f),
            "down": (f, h)}


def fp8_gemm_us(c: ModelConfig) -> dict[str, float]:
    """Per projection: the row-wise FP8 GEMM with fp32 sums at ROWS rows (us): cuBLASLt's
    (bench/fp8_gemm.py: the fastest such GEMM at hand)."""
    out = {}
    for name, (k, n) in projection_shapes(c).items():
        a, sa = quantize_ref(torch.randn(ROWS, k, device="cuda"))
        w, sw = quantize_ref(torch.randn(n, k, device="cuda") / k**0.5)
        y = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
        out[name] = graph_us(lambda a=a, sa=sa, w=w, sw=sw, y=y: torch._scaled_mm(
            a, w.t(), scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=y.dtype, out=y))
    return out


def gemm_us(c: ModelConfig) -> dict[str, float]:
    """Per projection: the faster of cuBLAS and cuBLASLt at ROWS rows (us)."""
    shapes = projection_shapes(c)
    out = {}
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for name, (k, n) in shapes.items():
            x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
            best = float("inf")
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                best = min(best, graph_us(lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y)))
            out[name] = best
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return out


def attention_us(c: ModelConfig, bs: int, s: int) -> dict[str, float | None]:
    """Causal attention of bs prompts of s tokens, per implementation (us; None: unsupported);
    with windowed layers also ours with their window ("ours-window")."""
    h, kvh, d, dev, dt = c.num_heads, c.num_kv_heads, c.head_dim, "cuda", torch.bfloat16
    t = bs * s
    q = torch.randn(t, h, d, device=dev, dtype=dt)
    k = torch.randn(t, kvh, d, device=dev, dtype=dt)
    v = torch.randn(t, kvh, d, device=dev, dtype=dt)
    cu = torch.arange(0, t + 1, s, dtype=torch.int32, device=dev)
    prefix = torch.zeros(bs, dtype=torch.int32, device=dev)
    table = torch.zeros(bs, 1, dtype=torch.int32, device=dev)
    pool = torch.zeros(16, kvh, d, device=dev, dtype=dt)
    out = torch.empty_like(q)
    batch = VarlenBatch(cu, prefix, table, 16, s, max_prefix_len=0, num_tokens=t)
    scale = c.softmax_scale
    res: dict[str, float | None] = {"ours": graph_us(lambda: extend_attention(
        q, k, v, pool, pool, batch, scale, out=out))}
    window = max(c.windows, default=0)
    if window:
        res["ours-window"] = graph_us(lambda: extend_attention(
            q, k, v, pool, pool, batch, scale, out=out, window=window))
    # the Hopper kernel at any size, as the prepared path binds it (the service's choice aside)
    res["ours-sm90"] = None
    if sm90.supported(q, k, v, out):
        launch = sm90.prepare_sm90(q, k, v, batch, None, out)
        res["ours-sm90"] = graph_us(lambda: launch(out))
    qb, kb, vb = (x.view(bs, s, -1, d).transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in SDPA.items():
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                res[name] = graph_us(lambda: F.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=True, enable_gqa=h != kvh))
        except RuntimeError as e:  # a backend that does not take this shape
            print(c.name, bs, s, name, "unsupported:", str(e)[:120], flush=True)
            res[name] = None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-0.5b,smollm2-135m,llama-3.2-1b")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    meta = run_meta() | {"gemm_ceiling_tflops": gemm_ceiling()}
    rows, table, split = [], [], []
    for name in args.models.split(","):
        cfg = preset(name)
        gemms = fp8_gemm_us(cfg) if args.fp8 else gemm_us(cfg)
        bf16_gemm_ms = cfg.num_layers * sum(gemm_us(cfg).values()) / 1e3 if args.fp8 else None
        gen = torch.Generator().manual_seed(0)
        model = random_model(cfg, "cuda", torch.bfloat16, seed=0)
        hf = hf_model(cfg)
        load_hf_state(model, hf.state_dict(), f"hf:{name}")  # the same weights
        hf_ms = run_hf(hf, cfg, gen)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        ours = {} if args.skip_ours else run_ours(
            LoadedModel(model, None, cfg, Path(name), 0.0),
            "ours-graph-fp8" if args.fp8 else "ours-graph", gen,
            SHAPES if args.breakdown else ())
        for bs, s in SHAPES:
            attn = attention_us(cfg, bs, s)
            # the bound as first defined: ours as dispatched and SDPA's backends
            fastest = min((a for a, x in attn.items()
                           if x is not None and a not in ("ours-sm90", "ours-window")),
                          key=attn.get)
            best = attn[fastest]
            # windowed layers: the faster of our windowed kernel and the best causal attention
            local = cfg.num_windowed_layers
            best_local = min(attn.get("ours-window") or best, best)
            attn_ms = ((cfg.num_layers - local) * best + local * best_local) / 1e3
            bound_ms = cfg.num_layers * sum(gemms.values()) / 1e3 + attn_ms
            key = f"{bs}x{s}"
            r = dict(model=name, shape=key, precision="fp8" if args.fp8 else "bf16",
                     gemm_us=gemms, attention_us=attn,
                     bound_ms=bound_ms, bound_tok_s=ROWS / bound_ms * 1e3,
                     bound_mfu=flops(cfg, bs, s) / (bound_ms / 1e3) / 1e12
                     / meta["gemm_ceiling_tflops"],
                     hf_ms=hf_ms[key]["ms"], hf_tok_s=ROWS / hf_ms[key]["ms"] * 1e3,
                     ours_ms=ours.get(key, {}).get("ms"))
            if bf16_gemm_ms is not None:
                r["bf16_bound_tok_s"] = ROWS / (bf16_gemm_ms + attn_ms) * 1e3
            r["ours_tok_s"] = ROWS / r["ours_ms"] * 1e3 if r["ours_ms"] else None
            ahead = ours.get(key, {}).get("ahead_ms")
            r["ours_ahead_tok_s"] = ROWS / ahead * 1e3 if ahead else None
            r["bound_over_hf"] = r["bound_tok_s"] / r["hf_tok_s"]
            prof = ours.get(key, {}).get("profile")
            if prof is not None:
                r["ours_profile"] = prof
                cls = {c: prof["classes"].get(c, {}).get("ms", 0.0)
                       for c in ("gemm", "attention", "other")}
                split.append([name, key, r["bound_ms"], r["ours_ms"],
                              f"{r['bound_ms'] / r['ours_ms']:.0%}", prof["wall_ms"],
                              cls["gemm"], sum(gemms.values()) * cfg.num_layers / 1e3,
                              cls["attention"], attn_ms, cls["other"],
                              prof["classes"].get("other", {}).get("calls", 0),
                              prof["span_ms"] - prof["kernel_ms"],
                              *(prof["gaps"][k]["ms"] for k in ("memset", "attention", "rest")),
                              prof["wall_ms"] - prof["span_ms"], prof["launches"]])
            rows.append(r)
            print(r, flush=True)
            table.append([name, key, sum(gemms.values()) * cfg.num_layers / 1e3,
                          attn_ms, fastest + (" (+ window)" if local else ""),
                          r["bound_tok_s"], r["bound_mfu"], r["hf_tok_s"], r["ours_tok_s"],
                          r["ours_tok_s"] / r["bound_tok_s"] if r["ours_tok_s"] else None,
                          r["ours_ahead_tok_s"],
                          r["ours_ahead_tok_s"] / r["bound_tok_s"] if r["ours_ahead_tok_s"]
                          else None,
                          r["bound_over_hf"],
                          r["ours_tok_s"] / r["hf_tok_s"] if r["ours_tok_s"] else None]
                         + ([r["bf16_bound_tok_s"]] if args.fp8 else []))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    gemm_kind = ("the row-wise FP8 GEMM (torch._scaled_mm, fp32 sums); ours with "
                 "QUANTIZATION=fp8" if args.fp8 else "the faster BLAS")
    md = (f"Lower bound of an 8,192-token prefill = layers x (four projections at {gemm_kind} "
          "+ the fastest causal attention); nothing else counted. tok/s at that bound "
          "against transformers' and ours in the same run. `bound / hf`: the largest speed-up "
          "over transformers any implementation with these kernels could reach.\n\n"
          f"GEMM ceiling (8192^3 bf16): {meta['gemm_ceiling_tflops']:.0f} TFLOP/s\n\n"
          + "`ours`: one forward at a time, launch to result; `ours, launched ahead`: each "
          "forward launched before the previous one's result is read, as the engine loop runs "
          "under load.\n\n"
          + markdown_table(["model", "shape", "GEMMs ms", "attention ms", "fastest attention",
                            "bound tok/s", "bound MFU", "hf tok/s", "ours tok/s", "ours / bound",
                            "ours, launched ahead, tok/s", "launched ahead / bound",
                            "bound / hf", "ours / hf"]
                           + (["bf16 bound tok/s"] if args.fp8 else []), table))
    if split:
        md += ("\n\nWhere ours' time goes (one profiled forward per shape; the profiler adds "
               "host time, so its wall exceeds the timed median): kernel time by class against "
               "the bound's share, `gaps` = GPU span − kernel time (idle between kernels), "
               "split by what borders each gap (a memset node, an attention launch, neither), "
               "`host` = profiled wall − GPU span (before the first kernel and after the last)."
               "\n\n" + markdown_table(
                   ["model", "shape", "bound ms", "ours ms", "of bound", "profiled ms",
                    "GEMM ms", "bound GEMM ms", "attention ms", "bound attention ms",
                    "other kernels ms", "other launches", "gaps ms", "at memsets",
                    "at attention", "elsewhere", "host ms", "launches"],
                   split))
    write_results(out_dir(), "bound", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
