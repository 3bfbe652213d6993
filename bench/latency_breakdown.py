"""Where a single small prompt's forward spends its wall time (host stages vs GPU time).

For each model and prompt length: the median wall time of `EngineCore.forward` (what bench/e2e.py
reports), then each stage alone with a device sync around it: building the batch on the host,
loading it into the full graph's buffers, the graph launch (host) and its GPU time (CUDA
events), the LM head, the last-row reductions and their copy to the host. Plus the torch
profiler's top host-side operators of one forward and, for a full graph, its top kernels by
GPU time. `--fold on,off,...` (FOLD_NORMS) and `--full-blas cublaslt,cublas,...`
(CUDA_GRAPH_FULL_BLAS) per run, interleaved (A/Bs on the same weights; the shorter list
repeats). `--blas cublaslt`: every GEMM of the process through that library
(torch.backends.cuda.preferred_blas_library).

Usage: python bench/latency_breakdown.py [--models smollm2-135m,llama-3.2-1b] [--tokens 128]
       [--fold on,off] [--full-blas cublaslt,cublas] [--blas cublas|cublaslt]
Writes latency_breakdown.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import engine_cfg  # noqa: E402
from service.engine.batch import SeqChunk, host_batch  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.engine.sampling import last_rows  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

REPS = 40


def median_ms(fn, sync: bool = True) -> float:
    times = []
    for i in range(REPS + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(REPS + 5):
        torch.cuda.synchronize()
        start.record(torch.cuda.current_stream())
        fn()
        end.record(torch.cuda.current_stream())
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def one(name: str, tokens: int, fold: bool = True, full_blas: str = "cublaslt"
        ) -> tuple[dict, list, list]:
    cfg = preset(name)
    loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16), None, cfg, Path(name), 0.0)
    engine = EngineCore(engine_cfg(True, fold=fold, full_blas=full_blas), loaded=loaded)
    runner, kv = engine.runner, engine.pool.cache
    ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    chunks = [SeqChunk(tuple(ids), 0, tuple(engine.pool.allocator.alloc(pages_for(tokens, 16))))]
    n = runner.pad_to_bucket(tokens)
    r = dict(model=name, tokens=tokens, fold=fold, full_blas=full_blas, bucket=n,
             full=runner.can_use_full(chunks, tokens))
    kernels: list = []
    r["forward"] = median_ms(lambda: engine.forward(chunks))
    r["forward_nosync_host"] = median_ms(lambda: engine.forward(chunks), sync=False)
    with torch.inference_mode(), runner.on_stream():
        r["host_batch"] = median_ms(lambda: host_batch(chunks, 16, pad_to=n), sync=False)
        if r["full"]:
            r["load"] = median_ms(lambda: runner.full_bufs.load(chunks, kv, n))
            batch = runner.full_bufs.load(chunks, kv, n)
            key = ("full", n)
            r["replay_host"] = median_ms(lambda: runner.backend.replay(key), sync=False)
            r["replay_wall"] = median_ms(lambda: runner.backend.replay(key))
            r["replay_gpu"] = gpu_ms(lambda: runner.backend.replay(key))
            hidden = runner.bufs.views(n).hidden
            r["lm_head"] = median_ms(lambda: runner.model.logits(hidden, batch.meta))
            logits = runner.model.logits(hidden, batch.meta)
            r["last_rows"] = median_ms(
                lambda: last_rows(logits.index_select(0, batch.last_rows)))
            r["last_rows_gpu"] = gpu_ms(
                lambda: last_rows(logits.index_select(0, batch.last_rows)))
            kernels = graph_kernels(lambda: runner.backend.replay(key))
            r["graph_kernels_ms"] = sum(k[1] for k in kernels)
            r["graph_launches"] = sum(k[2] for k in kernels)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.forward(chunks)
    top = [[e.key[:70], e.self_cpu_time_total / 10 / 1e3, e.count // 10]
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    engine.close()

    torch.cuda.empty_cache()
    return r, top, kernels


def graph_kernels(fn, reps: int = 10) -> list:
    """[name, GPU ms, launches] per kernel of one fn() (the mean of `reps` runs), by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [[e.key[:70], e.device_time_total / reps / 1e3, e.count // reps]
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda x: -x[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--tokens", default="128")
    ap.add_argument("--fold", default="on")
    ap.add_argument("--full-blas", default="cublaslt")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt"])
    args = ap.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    meta = run_meta() | {"blas": str(torch.backends.cuda.preferred_blas_library())}
    rows, tops, graphs, md = [], {}, {}, ""
    for name in args.models.split(","):
        for t in map(int, args.tokens.split(",")):
            folds = [f == "on" for f in args.fold.split(",")]
            blases = args.full_blas.split(",")
            for i in range(max(len(folds), len(blases))):
                fold, blas = folds[i % len(folds)], blases[i % len(blases)]
                r, top, kernels = one(name, t, fold, blas)
                rows.append(r)
                label = f"{name} {t} fold={fold} full_blas={blas}"
                tops[label], graphs[label] = top, kernels
                print(r, flush=True)
                if i >= 2:  # one table per variant: the first round's
                    continue
                md += (f"\n\n### {label}: host-side operators of one forward "
                       "(profiler self CPU ms, calls)\n\n"
                       + markdown_table(["op", "self cpu ms", "calls"], top))
                if kernels:
                    md += (f"\n\n### {label}: the full graph's kernels (GPU ms, launches)"
                           "\n\n" + markdown_table(["kernel", "gpu ms", "launches"],
                                                   kernels[:14]))
    keys = [k for k in rows[0] if k not in ("model", "tokens")]
    table = markdown_table(["model", "tokens", *keys],
                           [[r["model"], r["tokens"], *[r.get(k) for k in keys]] for r in rows])
    write_results(out_dir(), "latency_breakdown", meta,
                  {"rows": rows, "top": tops, "graph_kernels": graphs},
                  "All times in ms (medians).\n\n" + table + md)
    print(table + md)


if __name__ == "__main__":
    main()
