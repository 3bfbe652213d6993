"""Where the host's time goes inside one full-graph forward of a single prompt: perf_counter
stamps between the steps `PrefillRunner.forward_full` takes (selection, staging the batch and
its one copy, the graph launch, queuing the summary's copy back, the logits copy, building the
batch's metadata, waiting for the GPU, unpacking the summary), and `EngineCore.forward` whole,
medians over 300 forwards. Everything before "replay" keeps the GPU idle; the steps between
the launch and "wait" overlap the graph; "unpack" follows it.

Usage: python bench/host_split.py [--models smollm2-135m,llama-3.2-1b] [--tokens 128]
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
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.engine.sampling import unpack  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

STEPS = ["select", "stage", "replay", "fetch", "clone", "batch", "wait", "unpack"]
REPS, WARMUP = 300, 30


def split(name: str, tokens: int) -> dict:
    cfg = preset(name)
    loaded = LoadedModel(random_model(cfg, "cuda", torch.bfloat16), None, cfg, Path(name), 0.0)
    eng = EngineCore(engine_cfg(True), loaded=loaded)
    r, kv, fb = eng.runner, eng.pool.cache, eng.runner.full_bufs
    ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    chunks = [SeqChunk(tuple(ids), 0, tuple(eng.pool.allocator.alloc(pages_for(tokens, 16))))]
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
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward(chunks)
        t1 = time.perf_counter()
        if i >= WARMUP:
            for k, a, b in zip(STEPS, t, t[1:]):
                times[k].append((b - a) * 1e6)
            times["total"].append((t[-1] - t[0]) * 1e6)
            times["forward"].append((t1 - t0) * 1e6)
    eng.close()
    return dict(model=name, tokens=tokens,
                **{k: round(statistics.median(v), 1) for k, v in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    meta = run_meta()
    rows = []
    for name in args.models.split(","):
        rows.append(split(name, args.tokens))
        print(rows[-1], flush=True)
    keys = [*STEPS, "total", "forward"]
    md = ("Host microseconds per step (medians); `forward` is EngineCore.forward whole.\n\n"
          + markdown_table(["model", "tokens", *keys],
                           [[r["model"], r["tokens"], *[r[k] for k in keys]] for r in rows]))
    write_results(out_dir(), "host_split", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
