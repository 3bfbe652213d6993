"""Data-parallel attention on several GPUs: DP_SIZE 1 vs 2 prefill throughput, capture memory
and retained bytes per rank, KV tokens per rank.

One process per GPU (NCCL; NVLink multicast off, see bench/h200_session.sh). Every rank builds
the same random-weight model, shards its MLP, captures the default 58-bucket ladder to 8,192
tokens through bench/capture.py's worker (so capture memory is measured the same way), sizes
its KV pool at MEM_FRACTION_STATIC 0.85, then times `DPRunner.run` on its own prompts in
lockstep with the other ranks (the per-step path: count all-gather, batch build, graph replay,
logits). Each bucket keeps only its capture-only counts tensor. DP_SIZE 1 ("main") is the
service's non-DP configuration.

Usage: python -m bench.dp                      # 2 GPUs, ~3 minutes
       python -m bench.dp --dry-run            # CPU: 2 gloo processes, tiny model
Writes dp.json and dp.md (+ dp_throughput.png) to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.capture import PAGE, TINY, worker  # noqa: E402
from bench.common import markdown_table, out_dir, pyplot, run_meta, write_results  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.dp import close_dp, init_dp  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.1-8b")
CASES = ((8, 1024), (64, 128))  # prompts x tokens, per rank: 8,192-token steps
MB = float(1 << 20)


def throughput(prefill, runner, pool: KVPool, cases, iters: int, cuda: bool) -> list[dict]:
    """Prompt tokens/s of every rank's steps together; each rank prefills its own prompts."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for bs, s in cases:
        prompts = [tuple(torch.randint(0, runner.cfg.vocab_size, (s,), generator=g).tolist())
                   for _ in range(bs)]

        def step(prompts: list = prompts, s: int = s) -> str:
            chunks = [SeqChunk(p, 0, tuple(pool.allocator.alloc(-(-s // PAGE))))
                      for p in prompts]
            _, _, mode = prefill(chunks, pool.cache)
            if cuda:  # the logits stay on the device: wait for them, as a server would
                torch.cuda.synchronize(runner.device)
            for c in chunks:
                pool.allocator.free(list(c.pages))
            return mode

        for _ in range(2):
            mode = step()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if world > 1:  # the slowest rank sets the pace of the group
            took = took.to(runner.device) if cuda else took
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds = float(took.item())
        rows.append(dict(prompts=bs, tokens=s, mode=mode, iters=iters, seconds=seconds,
                         tokens_per_s=world * bs * s * iters / seconds))
    return rows


def rank_main(rank: int, world: int, port: int, spec: dict, result: str) -> None:
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    group = None
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        group = init_dp(rank, world, backend, f"tcp://127.0.0.1:{port}")
    then = None
    if spec.get("cases"):
        def then(prefill, runner, pool: KVPool) -> dict:
            return dict(throughput=throughput(prefill, runner, pool, spec["cases"],
                                              spec["iters"], cuda))
    out = worker(spec, group, then)
    out.update(world=world, rank=rank)
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, out)
        close_dp(group)
    else:
        everyone = [out]
    if rank == 0:
        Path(result).write_text(json.dumps(everyone))


def run(model: str, variant: str, world: int, args: argparse.Namespace) -> dict:
    """One configuration in fresh processes; rank 0's record plus every rank's memory."""
    from tests.engine.helpers import free_port

    device = "cpu" if args.dry_run else "cuda"
    spec = dict(model=model, variant=variant, device=device, max_tokens=args.max_tokens,
                cases=[list(c) for c in args.cases],
                iters=args.iters)
    if args.dry_run:
        spec["overrides"] = TINY
    label = f"{model} / DP {world} / {variant}"
    print(f"== {label}", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        try:
            mp.spawn(rank_main, args=(world, free_port(), spec, f.name), nprocs=world, join=True)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not stop the rest
            print(f"   failed: {e}", flush=True)
            return dict(model=model, variant=variant, world=world, error=str(e)[-300:])
        ranks = json.loads(Path(f.name).read_text())
    rec = dict(model=model, variant=variant, world=world, ranks=ranks)
    for r in ranks[:1]:
        print(f"   capture {r['capture_bytes'] / MB:.0f} MB, retained {r['retained_bytes']} B, "
              f"KV {r['kv_tokens']} tokens/rank", flush=True)
        for t in (r.get("then") or {}).get("throughput", []):
            print(f"   {t['prompts']}x{t['tokens']}: {t['tokens_per_s']:.0f} tok/s ({t['mode']})",
                  flush=True)
    return rec


def report(results: list[dict]) -> str:
    mem_rows, tput_rows, target_rows = [], [], []
    by = {(r["model"], r["world"], r["variant"]): r for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            mem_rows.append([r["model"], r["world"], r["variant"], r["error"]] + [""] * 8)
            continue
        for x in r["ranks"]:
            per = x.get("retained_per_bucket") or {}
            mem_rows.append([
                r["model"], r["world"], r["variant"], x["rank"], x["graphs"],
                x["capture_bytes"] / MB, x["reserved_growth_bytes"] / MB,
                x["eager_peak_bytes"] / MB, x["retained_bytes"],
                max(per.values()) if per else None, x["kv_tokens"],
                x["kv_tokens"] / max(x["kv_ideal_tokens"], 1)])
        if r["variant"] == "dp" and r["world"] > 1:
            worst = max(max((x.get("retained_per_bucket") or {0: 0}).values())
                        for x in r["ranks"])
            target_rows.append([f"{r['model']} DP {r['world']}: retained ≤ 4 KiB per bucket",
                                f"max {worst} B", "PASS" if worst <= 4096 else "FAIL"])
    for (model, world, _), r in sorted(by.items()):
        base = by.get((model, 1, "main"))
        for i, t in enumerate(r["ranks"][0].get("then", {}).get("throughput", [])):
            b = base["ranks"][0]["then"]["throughput"][i]["tokens_per_s"] if base else None
            tput_rows.append([model, world, f"{t['prompts']}x{t['tokens']}", t["mode"],
                              t["tokens_per_s"], t["tokens_per_s"] / b if b else None])
    return "\n\n".join([
        "## Prefill throughput (all ranks together; every rank prefills its own prompts)",
        markdown_table(["model", "DP size", "prompts per rank", "mode", "tok/s", "vs DP 1"],
                       tput_rows),
        "## Capture memory and KV per rank (MB = 2^20 B)",
        markdown_table(["model", "DP size", "variant", "rank", "graphs", "capture MB",
                        "reserved +MB", "eager peak MB", "retained B", "max B/bucket",
                        "KV tokens @0.85", "KV/ideal"], mem_rows),
        "## Targets", markdown_table(["target", "value", "result"], target_rows)])


def plot(results: list[dict], directory: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    ok = [r for r in results if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, vals = [], []
    for r in ok:
        for t in r["ranks"][0].get("then", {}).get("throughput", []):
            labels.append(f"{r['model']}\nDP {r['world']} {t['prompts']}x{t['tokens']}")
            vals.append(t["tokens_per_s"])
    ax.bar(range(len(vals)), vals)
    ax.set_xticks(range(len(vals)), labels, fontsize=6, rotation=45)
    ax.set_ylabel("prompt tokens/s")
    ax.set_title("prefill throughput, DP size 1 vs 2")
    fig.tight_layout()
    fig.savefig(directory / "dp_throughput.png", dpi=120)
    plt.close(fig)
    return ["dp_throughput.png"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", default="main,dp", help="main = DP size 1 (non-DP)")
    p.add_argument("--cases", default=",".join(f"{b}x{s}" for b, s in CASES))
    args = p.parse_args()
    args.cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.dry_run:
        args.models, args.max_tokens, args.iters = "smollm2-135m", 64, 1
        args.cases = [(2, 16)]
    else:
        assert torch.cuda.device_count() >= args.world, f"needs {args.world} GPUs"
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (KINDS.md)
    results, variants = [], args.variants.split(",")
    for model in args.models.split(","):
        for variant in variants:
            results.append(run(model, variant, 1 if variant == "main" else args.world, args))
    md = report(results)
    pngs = plot(results, out_dir())
    write_results(out_dir(), "dp", run_meta(), {"results": results},
                  md + "\n\nPlots: " + (", ".join(pngs) or "(matplotlib missing)"))
    print(md)


if __name__ == "__main__":
    main()
