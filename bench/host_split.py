"""Where the host's time goes inside one forward: perf_counter stamps between its steps and
`EngineCore.forward` whole, medians.

Full graph (`--path full`, one prompt of `--tokens`): the steps `PrefillRunner.forward_full`
takes (selection, staging the batch and its one copy, the graph launch, queuing the summary's
copy back, the logits copy, building the batch's metadata, waiting for the GPU, unpacking the
summary). Everything before "replay" keeps the GPU idle; the steps between the launch and
"wait" overlap the graph; "unpack" follows it.

Breakable graph (`--path breakable`, `--cases` such as 8x1024): selection, `build_batch`
(flattening on the host and its copy), the segment replays with their attention breaks (the
first break binds the attention launch) and the eager LM head, then the last rows' reduction
and its wait. `gpu_span` is the GPU time from the first segment's start to the LM head's end
(CUDA events): the forward's GPU work plus the idle gaps the host leaves inside it; `bind`
and `host_batch` time those two host steps again on their own.

Usage: python bench/host_split.py [--models smollm2-135m,llama-3.2-1b] [--tokens 128]
       python bench/host_split.py --path breakable --cases 8x1024,64x128,1x8192
Writes host_split.{json,md} to $OUT (default bench/results).
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
from service.engine.batch import SeqChunk, build_batch, host_batch  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.engine.sampling import last_rows, unpack  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

STEPS = ["select", "stage", "replay", "fetch", "clone", "batch", "wait", "unpack"]
BREAKABLE_STEPS = ["select", "build", "replay", "reduce"]
REPS, WARMUP = 300, 30


def engine(name: str) -> tuple[EngineCore, object]:
    cfg = preset(name)
    loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16), None, cfg, Path(name), 0.0)
    return EngineCore(engine_cfg(True), loaded=loaded), cfg


def prompts(eng: EngineCore, vocab: int, bs: int, s: int) -> list[SeqChunk]:
    """bs prompts of s random tokens, as the scheduler's requests chunk them (SeqChunk.of)."""
    ids = torch.randint(0, vocab, (bs, s)).tolist()
    return [SeqChunk.of(x, 0, eng.pool.allocator.alloc(pages_for(s, 16))) for x in ids]


def forward_us(eng: EngineCore, chunks: list[SeqChunk]) -> float:
    """One EngineCore.forward from an idle GPU, host microseconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.forward(chunks)
    return (time.perf_counter() - t0) * 1e6


def record(times: dict[str, list[float]], steps: list[str], stamps: list[float],
           **extra: float) -> None:
    """Each step's time from consecutive stamps, their total, and `extra` figures (us)."""
    for k, a, b in zip(steps, stamps, stamps[1:]):
        times[k].append((b - a) * 1e6)
    times["total"].append((stamps[-1] - stamps[0]) * 1e6)
    for k, v in extra.items():
        times[k].append(v)


def split(name: str, tokens: int) -> dict:
    eng, cfg = engine(name)
    r, kv, fb = eng.runner, eng.pool.cache, eng.runner.full_bufs
    chunks = prompts(eng, cfg.vocab_size, 1, tokens)
    assert r.can_use_full(chunks, tokens), "this prompt does not take a full graph"
    times: dict[str, list[float]] = {k: [] for k in [*STEPS, "total", "forward"]}
    for i in range(REPS + WARMUP):
        torch.cuda.synchronize()
        with torch.inference_mode():  # forward_full's steps, stamped
            t = [time.perf_counter()]
            r.can_use_full(chunks, tokens)
            n = r.pad_to_bucket(tokens)
            r.kv_addrs.bind(kv)
            t.append(time.perf_counter())
            fb.stage(chunks, n)
            t.append(time.perf_counter())
            r.backend.replay(("full", n))
            t.append(time.perf_counter())
            summary = fb.fetch_summary(1)
            t.append(time.perf_counter())
            fb.logits[:1].clone()
            t.append(time.perf_counter())
            fb.batch(chunks, kv, n, summary)
            t.append(time.perf_counter())
            fb.fetched_summary(summary)
            t.append(time.perf_counter())
            unpack(summary)
            t.append(time.perf_counter())
        forward = forward_us(eng, chunks)
        if i >= WARMUP:
            record(times, STEPS, t, forward=forward)
    eng.close()
    return dict(model=name, tokens=tokens,
                **{k: round(statistics.median(v), 1) for k, v in times.items()})


def split_breakable(eng: EngineCore, vocab: int, name: str, bs: int, s: int,
                    reps: int = 20, warmup: int = 5) -> dict:
    """`PrefillRunner.prefill`'s breakable-graph branch and EngineCore.forward's reduction,
    stamped."""
    r, kv = eng.runner, eng.pool.cache
    chunks = prompts(eng, vocab, bs, s)
    n = bs * s
    assert not r.can_use_full(chunks, n) and r.can_use_graph(n), "not a breakable-graph batch"
    keys = [*BREAKABLE_STEPS, "total", "gpu_span", "bind", "host_batch", "forward"]
    times: dict[str, list[float]] = {k: [] for k in keys}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(reps + warmup):
        torch.cuda.synchronize()
        with torch.inference_mode():
            t = [time.perf_counter()]
            r.can_use_full(chunks, n)
            graph, bucket = r.can_use_graph(n), r.pad_to_bucket(n)
            t.append(time.perf_counter())
            with r.on_stream():
                batch = build_batch(chunks, kv, r.device, pad_to=bucket if graph else n)
                t.append(time.perf_counter())
                start.record()
                logits = r.forward_graph(batch)
                end.record()
            t.append(time.perf_counter())
            last_rows(logits.index_select(0, batch.last_rows))
            t.append(time.perf_counter())
            with r.on_stream():
                b0 = time.perf_counter()
                r._plan(batch, r.bufs.views(bucket))
                b1 = time.perf_counter()
        h0 = time.perf_counter()
        host_batch(chunks, kv.page_size, bucket)
        h1 = time.perf_counter()
        forward = forward_us(eng, chunks)
        if i >= warmup:
            record(times, BREAKABLE_STEPS, t, gpu_span=start.elapsed_time(end) * 1e3,
                   bind=(b1 - b0) * 1e6, host_batch=(h1 - h0) * 1e6, forward=forward)
    for c in chunks:
        eng.pool.allocator.free(list(c.pages))
    return dict(model=name, case=f"{bs}x{s}",
                **{k: round(statistics.median(v), 1) for k, v in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--path", choices=("full", "breakable"), default="full")
    ap.add_argument("--cases", default="8x1024,64x128,1x8192")
    args = ap.parse_args()
    meta = run_meta()
    rows = []
    for name in args.models.split(","):
        if args.path == "full":
            rows.append(split(name, args.tokens))
            print(rows[-1], flush=True)
            continue
        eng, cfg = engine(name)
        for case in args.cases.split(","):
            bs, s = (int(x) for x in case.split("x"))
            rows.append(split_breakable(eng, cfg.vocab_size, name, bs, s))
            print(rows[-1], flush=True)
        eng.close()
    if args.path == "full":
        keys, first = [*STEPS, "total", "forward"], "tokens"
    else:
        keys = [*BREAKABLE_STEPS, "total", "gpu_span", "bind", "host_batch", "forward"]
        first = "case"
    md = ("Host microseconds per step (medians); `forward` is EngineCore.forward whole.\n\n"
          + markdown_table(["model", first, *keys],
                           [[r["model"], r[first], *[r[k] for k in keys]] for r in rows]))
    write_results(out_dir(), "host_split", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
