"""Where the GPU idles inside one forward: host time before the first kernel, the GPU span,
busy time, the gaps between kernels (largest first, with their neighbours) and the host time
after the last kernel, from one torch-profiler trace per case (graphs on, as the service runs).

The profiler inflates host times (every op is recorded); the GPU-side figures are exact.

Usage: python bench/timeline_gaps.py
Writes timeline_gaps.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import engine_cfg, timed  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

CASES = {"smollm2-135m": [(64, 128), (8, 1024), (1, 8192)],
         "llama-3.2-1b": [(1, 8192), (8, 1024)]}


def trace(engine: EngineCore, chunks: list[SeqChunk]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.forward(chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.forward(chunks)
        torch.cuda.synchronize()
    gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    cpu = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CUDA]
    c0, c1 = min(e.time_range.start for e in cpu), max(e.time_range.end for e in cpu)
    g0, g1 = gpu[0].time_range.start, max(e.time_range.end for e in gpu)
    gaps, end = [], gpu[0].time_range.end
    for prev, ev in zip(gpu, gpu[1:]):
        if ev.time_range.start > end:
            gaps.append((ev.time_range.start - end, prev.name[:50], ev.name[:50]))
        end = max(end, ev.time_range.end)
    gaps.sort(reverse=True)
    return dict(host_before_gpu_ms=(g0 - c0) / 1e3, gpu_span_ms=(g1 - g0) / 1e3,
                gpu_busy_ms=sum(e.time_range.end - e.time_range.start for e in gpu) / 1e3,
                gaps_ms=sum(g[0] for g in gaps) / 1e3, gaps_over_20us=sum(g[0] > 20 for g in gaps),
                host_after_gpu_ms=(c1 - g1) / 1e3,
                top_gaps=[dict(us=round(g[0], 1), after=g[1], before=g[2]) for g in gaps[:8]])


def main() -> None:
    meta = run_meta()
    rows = []
    for name, cases in CASES.items():
        cfg = preset(name)
        loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16), None, cfg, Path(name), 0.0)
        gen = torch.Generator().manual_seed(0)
        engine = EngineCore(engine_cfg(True), loaded=loaded)
        for bs, s in cases:
            ids = torch.randint(0, cfg.vocab_size, (bs, s), generator=gen).tolist()
            pages = [engine.pool.allocator.alloc(pages_for(s, 16)) for _ in range(bs)]
            chunks = [SeqChunk(tuple(x), 0, tuple(p)) for x, p in zip(ids, pages)]
            row = dict(model=name, case=f"{bs}x{s}",
                       timed_ms=timed(lambda e=engine, c=chunks: e.forward(c), 10),
                       **trace(engine, chunks))
            rows.append(row)
            print(row, flush=True)
            for p in pages:
                engine.pool.allocator.free(p)
        engine.close()
        del engine, loaded
        torch.cuda.empty_cache()
    keys = ["timed_ms", "host_before_gpu_ms", "gpu_span_ms", "gpu_busy_ms", "gaps_ms",
            "gaps_over_20us", "host_after_gpu_ms"]
    md = markdown_table(["model", "case"] + keys, [[r["model"], r["case"]] + [r[k] for k in keys]
                                                  for r in rows])
    for r in rows:
        md += f"\n\n### {r['model']} {r['case']}: largest gaps\n\n" + markdown_table(
            ["us", "after", "before"], [[g["us"], g["after"], g["before"]] for g in r["top_gaps"]])
    write_results(out_dir(), "timeline_gaps", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
