"""What fusing each small kernel family away could save one small prompt's full CUDA graph.

For one prompt of --tokens tokens (a full graph: the whole forward in one launch), the graph's
GPU time and the forward's wall time, first as the service runs it, then with one kernel family
(RoPE, SiLU-and-mul, the fused residual-add + RMSNorm, or RoPE and SiLU together) replaced by a
no-op before capture. The output is garbage then, but every other kernel's time does not depend
on the values, so the difference is an upper bound of what folding that family into its
neighbours can save: its kernels' own time plus the launch gaps between them in the graph.
Variants alternate in --rounds rounds, each with a fresh engine (capture included).

Usage: python bench/fusion_bound.py [--models smollm2-135m,llama-3.2-1b] [--tokens 128]
Writes fusion_bound.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.ops as ops  # noqa: E402
from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import engine_cfg  # noqa: E402
from bench.latency_breakdown import gpu_ms, median_ms  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

REAL = {name: getattr(ops, name) for name in ("apply_rope", "silu_and_mul", "fused_add_rms_norm")}
NOOP = {"apply_rope": lambda q, k, *a, **kw: None,  # in place: q, k keep their values
        "silu_and_mul": lambda gu, out=None, **kw: out,
        "fused_add_rms_norm": lambda x, residual, *a, **kw: (x, residual)}
VARIANTS = {"base": (), "no-rope": ("apply_rope",), "no-silu": ("silu_and_mul",),
            "no-addnorm": ("fused_add_rms_norm",), "no-rope-silu": ("apply_rope", "silu_and_mul")}


def measure(model, cfg, name: str, tokens: int, off: tuple[str, ...]) -> tuple[float, float]:
    """(full graph GPU ms, forward wall ms) with the `off` families replaced by no-ops."""
    for fn_name, fn in REAL.items():
        setattr(ops, fn_name, NOOP[fn_name] if fn_name in off else fn)
    try:
        ecfg = dataclasses.replace(engine_cfg(True), cuda_graph_buckets=(tokens,))
        engine = EngineCore(ecfg, loaded=LoadedModel(model, None, cfg, Path(name), 0.0))
        ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
        pages = engine.pool.allocator.alloc(pages_for(tokens, 16))
        chunks = [SeqChunk(tuple(ids), 0, tuple(pages))]
        runner = engine.runner
        assert runner.can_use_full(chunks, tokens), "the prompt must take a full graph"
        engine.forward(chunks)  # binds the KV pool's addresses, as every forward does
        with torch.inference_mode(), runner.on_stream():
            runner.kv_addrs.bind(engine.pool.cache)
            runner.full_bufs.load(chunks, engine.pool.cache, tokens)
            graph = gpu_ms(lambda: runner.backend.replay(("full", tokens)))
        wall = median_ms(lambda: engine.forward(chunks))
        engine.close()
        return graph, wall
    finally:
        for fn_name, fn in REAL.items():
            setattr(ops, fn_name, fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    meta = run_meta()
    rows = []
    for name in args.models.split(","):
        cfg = preset(name)
        model = random_model(cfg, "cuda", torch.bfloat16)
        for rnd in range(args.rounds):
            for vname, off in VARIANTS.items():
                graph, wall = measure(model, cfg, name, args.tokens, off)
                rows.append(dict(model=name, variant=vname, round=rnd, replay_gpu_ms=graph,
                                 forward_ms=wall))
                print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    table = []
    for name in args.models.split(","):
        base = statistics.median(r["replay_gpu_ms"] for r in rows
                                 if (r["model"], r["variant"]) == (name, "base"))
        for vname in VARIANTS:
            mine = [r for r in rows if (r["model"], r["variant"]) == (name, vname)]
            g = statistics.median(r["replay_gpu_ms"] for r in mine)
            table.append([name, vname, g, (base - g) * 1e3,
                          statistics.median(r["forward_ms"] for r in mine)])
    md = (f"One {args.tokens}-token prompt through its full graph; medians over {args.rounds} "
          "rounds. `saved` = base graph GPU time minus this variant's: the most that fusing "
          "those kernels into their neighbours could save.\n\n"
          + markdown_table(["model", "variant", "graph GPU ms", "saved us", "forward ms"], table))
    write_results(out_dir(), "fusion_bound", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
