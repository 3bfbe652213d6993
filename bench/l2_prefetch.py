"""What reading the next layer's weights into L2 (CUDA_GRAPH_L2_PREFETCH) does to full graphs.

For each model and prompt shape: the full graph's GPU time and EngineCore.forward's wall time,
without prefetch and with it (how many segments ahead, how many programs per launch), each
variant a fresh engine (capture included) with buckets 128 and 1,024 only, variants alternating
over --rounds rounds. Every variant's logits are compared with the first variant's of its round:
a prefetch writes nothing, so they must be identical.

Usage: python bench/l2_prefetch.py [--models smollm2-135m,qwen2.5-0.5b] [--rounds 2]
       [--variants off,a1p32,a0p32,a1p64] [--max-mib 64]
Writes l2_prefetch.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import engine_cfg  # noqa: E402
from bench.latency_breakdown import gpu_ms, median_ms  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.engine.runner import PrefillRunner  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

SHAPES = ((1, 128), (1, 1024), (8, 128))  # (prompts, tokens each)


def variant(label: str) -> tuple[bool, int, int]:
    """'off' or 'a<ahead>p<programs>' -> (on, ahead, programs)."""
    if label == "off":
        return False, 1, 32
    ahead, programs = label[1:].split("p")
    return True, int(ahead), int(programs)


def measure(model, cfg, label: str, max_bytes: int, gen: torch.Generator) -> list[dict]:
    on, ahead, programs = variant(label)
    PrefillRunner.l2_ahead, PrefillRunner.l2_programs = ahead, programs
    PrefillRunner.l2_max_bytes = max_bytes
    ecfg = dataclasses.replace(engine_cfg(True, l2_prefetch=on), cuda_graph_buckets=(128, 1024))
    loaded = LoadedModel(model, None, cfg, Path(label), 0.0)
    engine = EngineCore(ecfg, loaded=loaded)
    runner, out = engine.runner, []
    try:
        for prompts, tokens in SHAPES:
            ids = torch.randint(0, cfg.vocab_size, (prompts, tokens), generator=gen).tolist()
            chunks = [SeqChunk(tuple(row), 0, tuple(engine.pool.allocator.alloc(
                pages_for(tokens, 16)))) for row in ids]
            n = runner.pad_to_bucket(prompts * tokens)
            assert runner.can_use_full(chunks, n), "shape does not replay a full graph"
            logits = torch.stack([x[-1] for x in engine.forward(chunks).logits])
            forward = median_ms(lambda c=chunks: engine.forward(c))
            gpu = gpu_ms(lambda k=("full", n): runner.backend.replay(k))
            out.append(dict(model=cfg.name, variant=label, prompts=prompts, tokens=tokens,
                            prefetching=runner._l2 is not None, graph_gpu_ms=gpu,
                            forward_ms=forward, logits=logits.cpu()))
            for c in chunks:
                engine.pool.allocator.free(list(c.pages))
    finally:
        engine.close()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--variants", default="off,a1p32,a0p32,a1p64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-mib", type=int, default=64,
                    help="prefetch layers up to this size (the service's bound is 16 MiB)")
    args = ap.parse_args()
    meta = run_meta()
    results = []
    for name in args.models.split(","):
        cfg = preset(name)
        model = random_model(cfg, "cuda", torch.bfloat16)
        for r in range(args.rounds):
            first = None
            for label in args.variants.split(","):
                gen = torch.Generator().manual_seed(r)  # the same prompts for every variant
                rows = measure(model, cfg, label, args.max_mib << 20, gen)
                if first is None:
                    first = rows
                for row, ref in zip(rows, first):
                    row["identical"] = bool(torch.equal(row["logits"], ref["logits"]))
                    row["round"] = r
                    print({k: v for k, v in row.items() if k != "logits"}, flush=True)
                results += rows
            for row in results:
                row.pop("logits", None)
        del model
        torch.cuda.empty_cache()
    table = []
    for name in args.models.split(","):
        for prompts, tokens in SHAPES:
            for label in args.variants.split(","):
                rs = [x for x in results if x["model"] == name and x["variant"] == label
                      and x["prompts"] == prompts and x["tokens"] == tokens]
                if rs:
                    table.append([name, f"{prompts} x {tokens}", label, rs[0]["prefetching"],
                                  statistics.median(x["graph_gpu_ms"] for x in rs),
                                  statistics.median(x["forward_ms"] for x in rs),
                                  all(x["identical"] for x in rs)])
    md = ("Full graph GPU ms and EngineCore.forward ms (medians over rounds); `identical`: the "
          "logits equal the round's first variant's bit for bit.\n\n"
          + markdown_table(["model", "shape", "variant", "prefetching", "graph GPU ms",
                            "forward ms", "identical"], table))
    write_results(out_dir(), "l2_prefetch", meta, {"rows": results}, md)
    print(md)


if __name__ == "__main__":
    main()
