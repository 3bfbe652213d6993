"""GPU time of the attention launch of small batches (what a full graph replays per layer).

For each model shape and token count: one prompt, through a grid sized as the full graph sizes
it (the bucket's q-blocks x CUDA_GRAPH_FULL_MAX_SEQS sequences, the unused ones empty) and as
the breakable path sizes it (the live batch), per kernel configuration. Each launch is captured
20 times in one CUDA graph and replayed, so host time is not in the figure.

Usage: python bench/small_attention.py [--split-only]   (writes small_attention.{json,md} to $OUT)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, markdown_table, out_dir, run_meta, write_results  # noqa: E402
from kernels.extend_attention import AttnConfig, pick_config, prepare_extend_attention  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64),
          "llama-3.1-8b": (32, 8, 128)}
TOKENS = (128, 512, 1024)
SEQS = 8
CONFIGS = {"table": None, "m64n64w4s2": AttnConfig(64, 64, 4, 2),
           "m64n32w4s2": AttnConfig(64, 32, 4, 2), "m32n32w4s2": AttnConfig(32, 32, 4, 2),
           "m128n32w4s2": AttnConfig(128, 32, 4, 2), "m64n64w4s3": AttnConfig(64, 64, 4, 3)}
REPS = 20


def case(h: int, kvh: int, d: int, n: int, cfg: AttnConfig | None, full: bool,
         seqs: int | None = None, prefix_loop: bool | None = None, table: bool | None = None
         ) -> float:
    """full: the full graph's launch (8 sequences, prefix loop compiled in, cache addresses
    read from memory); seqs / prefix_loop / table override one of those three at a time."""
    dev, dt = "cuda", torch.bfloat16
    qkv = torch.randn(n, (h + 2 * kvh) * d, device=dev, dtype=dt)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
    pool_k = torch.zeros(4096, kvh, d, device=dev, dtype=dt)
    pool_v = torch.zeros_like(pool_k)
    b = seqs or (SEQS if full else 1)
    prefix_loop = full if prefix_loop is None else prefix_loop
    addr_table = full if table is None else table
    cu = torch.tensor([0] + [n] * b, dtype=torch.int32, device=dev)
    prefix = torch.zeros(b, dtype=torch.int32, device=dev)
    table = torch.arange(b * 2048, dtype=torch.int32, device=dev).view(b, 2048) % 256
    slots = torch.arange(n, device=dev)
    out = torch.empty(n, h, d, device=dev, dtype=dt)
    addrs = torch.tensor([[pool_k.data_ptr()], [pool_v.data_ptr()]], device=dev)
    launch, _, _ = prepare_extend_attention(
        q, k, v, pool_k, pool_v, cu, prefix, table, 16, n, None, out, config=cfg,
        store_slots=slots, max_prefix_len=None if prefix_loop else 0,
        cache_table=(addrs[0], addrs[1]) if addr_table else None)
    if addr_table:
        return graph_us(lambda: launch(addrs[0], addrs[1]), REPS)
    return graph_us(lambda: launch(pool_k, pool_v), REPS)


def main() -> None:
    meta = run_meta()
    rows, results = [], []
    sweep = SHAPES if "--split-only" not in sys.argv else {}
    for name, (h, kvh, d) in sweep.items():
        for n in TOKENS:
            for label, cfg in CONFIGS.items():
                if cfg is not None and d == 128 and cfg.block_m * cfg.block_n > 64 * 64:
                    continue
                r = dict(model=name, tokens=n, config=label)
                for grid in ("full", "live"):
                    try:
                        r[grid] = case(h, kvh, d, n, cfg, grid == "full")
                    except Exception as e:  # noqa: BLE001 - a config that cannot compile
                        r[grid] = None
                        print(name, n, label, grid, "failed:", repr(e)[:200], flush=True)
                results.append(r)
                rows.append([name, n, label, r["full"], r["live"]])
                print(rows[-1], flush=True)
    # which of the full graph's three differences costs what
    split = []
    for name in ("smollm2-135m", "llama-3.1-8b"):
        h, kvh, d = SHAPES[name]
        for n in (128, 512):
            for label in ("table", "m64n64w4s3"):
                cfg = CONFIGS[label]
                r = dict(model=name, tokens=n, config=label,
                         live=case(h, kvh, d, n, cfg, False),
                         seqs8=case(h, kvh, d, n, cfg, False, seqs=SEQS),
                         prefix_loop=case(h, kvh, d, n, cfg, False, prefix_loop=True),
                         addr_table=case(h, kvh, d, n, cfg, False, table=True),
                         full=case(h, kvh, d, n, cfg, True))
                split.append(r)
                print(r, flush=True)
    table = pick_config(64, torch.bfloat16, torch.device("cuda"))
    md = (f"table config (D=64): {table}\n\n"
          + markdown_table(["model", "tokens", "config", "full-graph grid us", "live grid us"],
                           rows)
          + "\n\n## What the full graph's launch adds (us)\n\n"
          + markdown_table(["model", "tokens", "config", "live", "8 seqs", "prefix loop",
                            "address table", "full"],
                           [[r["model"], r["tokens"], r["config"], r["live"], r["seqs8"],
                             r["prefix_loop"], r["addr_table"], r["full"]] for r in split]))
    write_results(out_dir(), "small_attention", meta, {"rows": results, "split": split}, md)
    print(md)


if __name__ == "__main__":
    main()
