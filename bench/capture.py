"""Breakable CUDA-graph capture: memory, time, KV capacity left, and forward latency.

Random weights of SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B shapes, the default 58-bucket
ladder to 8,192 tokens. Each (model, variant) runs in a fresh process, so that one run's
lazily loaded kernels and driver-cached graph memory cannot flatter the next:
  main      the service's configuration (retention gated, one shared pool) + latency
  warm      main, after an eager forward of every bucket: splits off first-use kernel loading
  dp1       the data-parallel path at world size 1 (retained capture-only tensors per bucket)
Capture memory = drop in free device memory across capture (static buffers included), after a
warm-up forward of the largest bucket; with the allocator's reserved growth beside it.

Usage: python -m bench.capture                   # one H200, ~5 minutes
       python -m bench.capture --dry-run         # CPU, tiny model: the logic and the report
       python -m bench.capture --sanitize-smoke  # tiny capture + replay for compute-sanitizer
Writes capture.json, capture.md and capture_*.png to $OUT (default bench/results) and prints
the markdown last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import bench_ms, out_dir, relerr, run_meta  # noqa: E402
from service.engine.batch import SeqChunk, build_batch  # noqa: E402
from service.engine.dp import DPGroup, DPRunner  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402
from service.engine.memory import plan_kv  # noqa: E402
from service.engine.runners import eager_peak_bytes, on_stream  # noqa: E402
from service.engine.runners.breakable import BreakableRunner  # noqa: E402
from service.engine.runners.buckets import Buckets, default_ladder  # noqa: E402
from service.engine.runners.eager import EagerRunner  # noqa: E402
from service.engine.runners.full_buffers import capture_chunks  # noqa: E402
from service.engine.runners.graph import CudaGraphBackend, SegmentBackend  # noqa: E402
from service.model.decoder import Eager  # noqa: E402
from service.model.families import preset  # noqa: E402
from service.model.loader import random_model  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")
LAT_TOKENS = (16, 64, 256, 1024, 4096, 8192)
PAGE, FRACTION = 16, 0.85
# Most informative first, so a tight --budget-s still yields the key comparisons.
RUNS = [(m, "main") for m in MODELS] + [("smollm2-135m", "warm"), ("smollm2-135m", "dp1")] + [
    (m, "warm") for m in ("llama-3.2-1b", "qwen2.5-0.5b")]
TINY = dict(num_layers=2, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4,
            num_kv_heads=2, head_dim=16)


class Mem:
    """Free device memory and the allocator's reserved bytes (zeros on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def free(self) -> int:
        return torch.cuda.mem_get_info()[0] if self.cuda else 0

    def reserved(self) -> int:
        return torch.cuda.memory_reserved() if self.cuda else 0


def one_sequence(runner: BreakableRunner, pool: KVPool, n: int):
    ids = torch.randint(0, runner.cfg.vocab_size, (n,)).tolist()
    pages = tuple(pool.allocator.alloc(-(-n // PAGE)))
    batch = build_batch([SeqChunk(tuple(ids), 0, pages)], pool.cache, runner.device,
                        pad_to=runner.buckets.pad_to_bucket(n))
    return batch, list(pages)


def latency_one(runner: BreakableRunner, pool: KVPool, n: int, cuda: bool) -> dict:
    """Eager vs breakable replay vs the same forward captured whole (fixed batch)."""
    model = runner.model
    with torch.inference_mode(), on_stream(runner.stream):
        batch, pages = one_sequence(runner, pool, n)
        v = runner.bufs.views(batch.padded_tokens)
        attend = runner._plan(batch, v)
        eager = lambda: model(batch.input_ids, batch.positions, batch.meta)
        breakable = lambda: runner.forward(batch)

        def direct() -> torch.Tensor:
            v.input_ids.copy_(batch.input_ids)
            v.positions.copy_(batch.positions)
            model.run(v, Eager(attend))
            return model.logits(v.hidden, batch.meta)

        full, g = direct, None
        if cuda:  # attention and the LM head inside the graph: fine for a fixed batch
            direct()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=runner.stream):
                full_out = direct()
            full = lambda: (g.replay(), full_out)[1]
        err = relerr(breakable(), eager())
        err_full = relerr(full(), breakable())
        ms = {k: bench_ms(f, cuda) for k, f in
              (("eager_ms", eager), ("breakable_ms", breakable), ("full_graph_ms", full))}
        if g is not None:
            g.reset()
    pool.allocator.free(pages)
    print(f"  latency {n:5d} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
          flush=True)
    return dict(tokens=n, **ms, relerr_vs_eager=err, relerr_full=err_full)


def latency(runner: BreakableRunner, cuda: bool, sizes: tuple[int, ...]) -> list[dict]:
    pool = KVPool(runner.cfg, max(sizes) + PAGE, PAGE, runner.dtype, runner.device)
    return [latency_one(runner, pool, n, cuda) for n in sizes]


def route(runner: BreakableRunner, eager: EagerRunner, chunks, kv) -> tuple:
    """The graph runner when it takes the batch (a DP runner always does), else eager."""
    take = runner.can_run(chunks, sum(c.num_tokens for c in chunks))
    return (runner if take else eager).run(chunks, kv)


def worker(spec: dict, group: DPGroup | None = None,
           then: Callable[[Callable, BreakableRunner, KVPool], dict] | None = None) -> dict:
    """One (model, variant) run. `group`: this rank of a multi-GPU DP group (bench/dp.py);
    `then(prefill, runner, pool)` runs on the captured runner and the KV pool sized at
    FRACTION, its result stored under "then" (bench/dp.py's throughput)."""
    cuda = spec["device"] == "cuda"
    mem = Mem(cuda)
    dev = torch.device(spec["device"])
    if cuda:
        torch.zeros(1, device=dev)  # CUDA context first: free_before excludes it, as in the service
    free_before = mem.free()
    cfg = preset(spec["model"], **spec.get("overrides", {}))
    dtype = torch.bfloat16 if cuda else torch.float32
    model = random_model(cfg, dev, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    variant = spec["variant"]
    stream = torch.cuda.Stream() if cuda else None
    backend = CudaGraphBackend(stream) if cuda else SegmentBackend()
    dp = group if group is not None else (DPGroup() if variant == "dp1" else None)
    buckets = Buckets(default_ladder(spec["max_tokens"]))
    runner = (BreakableRunner(model, buckets, backend, stream) if dp is None
              else DPRunner(model, buckets, backend, dp, stream))
    eager = runner if dp is not None else EagerRunner(model, stream)
    scratch = KVPool(cfg, PAGE, PAGE, dtype, dev)
    out: dict = dict(model=spec["model"], variant=variant, weights_bytes=weights,
                     buckets=len(runner.buckets), free_before=free_before)
    if variant == "warm":  # first-use kernel loading, measured apart from the capture
        mem.settle()
        f0, r0 = mem.free(), mem.reserved()
        with torch.inference_mode():
            for n in runner.buckets:
                eager.run(capture_chunks(n, model.max_positions, PAGE), scratch.cache)
        mem.settle()
        out.update(kernel_load_bytes=f0 - mem.free(), sweep_reserved_bytes=mem.reserved() - r0)
    big = capture_chunks(spec["max_tokens"], model.max_positions, PAGE)
    with torch.inference_mode(), on_stream(stream):
        out["eager_peak_bytes"] = eager_peak_bytes(dev, lambda kv=scratch.cache: eager.run(big, kv))
    mem.settle()
    f0, r0, t0 = mem.free(), mem.reserved(), time.perf_counter()

    def progress(k: int, n: int) -> None:
        if k % 10 == 0 or n == runner.buckets.sizes[0]:
            print(f"  [{spec['model']}/{variant}] bucket {n:5d} ({k + 1}/{len(runner.buckets)})"
                  f", {mem.free() / 2**30:.2f} GiB free", flush=True)

    runner.capture(scratch.cache, on_bucket=progress)
    mem.settle()
    out["capture_s"] = time.perf_counter() - t0
    del scratch
    mem.settle()
    f1, r1 = mem.free(), mem.reserved()
    out.update(capture_bytes=f0 - f1, reserved_growth_bytes=r1 - r0, graphs=backend.num_graphs,
               static_bytes=runner.static_bytes, retained_bytes=backend.retained_bytes(),
               free_after_capture=f1)
    out["pool_bytes"] = out["reserved_growth_bytes"] - out["static_bytes"]
    out["non_allocator_bytes"] = out["capture_bytes"] - out["reserved_growth_bytes"]
    if dp is not None:
        out["retained_per_bucket"] = {n: backend.retained(n).nbytes for n in runner.captured}
    fb, fn = (free_before, f1) if cuda else (64 << 20, (64 << 20) - weights)  # CPU: pretend
    plan = plan_kv(fb, fn, FRACTION, cfg, dtype.itemsize, PAGE, (2 << 20) if cuda else 1)
    pool = KVPool(cfg, max(plan.tokens, PAGE), PAGE, dtype, dev)  # allocates: it must fit
    out.update(kv_bytes_formula=plan.kv_bytes, kv_ideal_tokens=plan.kv_bytes // max(
        cfg.kv_bytes_per_token(dtype.itemsize), 1), kv_tokens=pool.capacity_tokens,
        kv_pool_bytes=pool.nbytes)
    if then is not None:
        out["then"] = then(lambda chunks, kv: route(runner, eager, chunks, kv), runner, pool)
    del pool
    mem.settle()
    if spec.get("latency"):
        out["latency"] = latency(runner, cuda, tuple(spec["latency"]))
    runner.close()
    backend.close()
    return out


def sanitize_smoke() -> None:
    """Tiny capture + replay (prefix in the paged pool, padding) vs eager, no timing and no
    KV sizing: quick under `compute-sanitizer --tool memcheck`."""
    cfg = preset("smollm2-135m", **TINY)
    model = random_model(cfg, "cuda", torch.bfloat16)
    stream = torch.cuda.Stream()
    backend = CudaGraphBackend(stream)
    runner = BreakableRunner(model, Buckets((16, 64)), backend, stream)
    runner.capture(KVPool(cfg, PAGE, PAGE, torch.bfloat16, "cuda").cache)
    pool = KVPool(cfg, 256, PAGE, torch.bfloat16, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (70,)).tolist()
    pages = tuple(pool.allocator.alloc(5))
    worst = 0.0
    with torch.inference_mode():
        runner.run([SeqChunk(tuple(ids[:20]), 0, pages)], pool.cache)  # a 20-token prefix
        for new in (ids[20:31], ids[20:70]):  # 11 -> bucket 16, 50 -> bucket 64
            with on_stream(stream):
                batch = build_batch([SeqChunk(tuple(new), 20, pages)], pool.cache, "cuda",
                                    pad_to=runner.buckets.pad_to_bucket(len(new)))
                worst = max(worst, relerr(runner.forward(batch),
                                          model(batch.input_ids, batch.positions, batch.meta)))
    torch.cuda.synchronize()
    graphs = backend.num_graphs
    runner.close()
    backend.close()
    print(f"sanitize smoke: {graphs} graphs captured and freed, replay vs eager relerr "
          f"{worst:.2e}")
    assert worst <= 1e-3, worst


def run_all(args: argparse.Namespace) -> list[dict]:
    results, t_start = [], time.perf_counter()
    for model, variant in RUNS:
        if args.models and model not in args.models:
            continue
        spec = dict(model=model, variant=variant, device="cuda", max_tokens=args.max_tokens,
                    latency=list(LAT_TOKENS) if variant == "main" else None)
        if time.perf_counter() - t_start > args.budget_s:
            results.append(dict(model=model, variant=variant, error="skipped: time budget"))
            continue
        print(f"== {model} / {variant}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            proc = subprocess.run([sys.executable, "-m", "bench.capture", "--worker",
                                   json.dumps(spec), "--result", f.name],
                                  cwd=Path(__file__).resolve().parents[1], timeout=300)
            if proc.returncode == 0:
                results.append(json.loads(Path(f.name).read_text()))
            else:
                results.append(dict(model=model, variant=variant,
                                    error=f"worker exit {proc.returncode}"))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sanitize-smoke", action="store_true")
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=330.0, help="skip runs after this")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(json.loads(args.worker))))
        return
    if args.sanitize_smoke:
        sanitize_smoke()
        return
    from bench.capture_report import write_report

    if args.dry_run:
        variants = ("main", "dp1", "warm")
        results = [worker(dict(model="smollm2-135m", variant=v, device="cpu", max_tokens=64,
                               overrides=TINY, latency=[16, 64] if v == "main" else None))
                   for v in variants]
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --dry-run)"
        results = run_all(args)
    print(write_report(out_dir(), run_meta(), results))


if __name__ == "__main__":
    main()
