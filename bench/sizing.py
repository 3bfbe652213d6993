"""Start-up sizing per model family: what the engine reports once it is ready, with the default
settings (MEM_FRACTION_STATIC, CUDA-graph ladder, full graphs), each preset in a fresh process.

Per preset: weights, capture memory, KV pool bytes and tokens, KV bytes per token and the
windowed layers' share of it (Gemma 3's sliding-window layers keep every token in the pool), the
tokens a window-sized pool for those layers would hold in the same bytes, and readiness time.

A model given as `name:fp8` runs with QUANTIZATION=fp8 (weights e4m3, the pool sized after).

Usage: [MODEL_PATH=<a tokenizer's checkpoint>] python bench/sizing.py [--models a,b:fp8,...]
Writes sizing.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402

MODELS = "llama-3.1-8b,qwen3-0.6b,qwen3-8b,gemma-3-270m,gemma-3-1b"
GIB = 1 << 30


def measure(name: str) -> dict:
    """In this process: an EngineCore on random `name` weights, as `python -m service` sizes it."""
    import dataclasses
    import os

    import torch

    from service.config import load_settings, resolve
    from service.engine.core import EngineCore

    t0 = time.perf_counter()
    preset_name, _, quantization = name.partition(":")
    settings = load_settings({**os.environ, "MODEL_PRESET": preset_name,
                              "QUANTIZATION": quantization or "none"})
    eng_cfg, _ = resolve(settings, torch.cuda.is_available())
    engine = EngineCore(eng_cfg)
    ready_s = time.perf_counter() - t0
    info = engine.info()
    c = engine.model_cfg
    engine.close()
    return dict(model=name, quantization=info.quantization, ready_s=ready_s,
                memory=dataclasses.asdict(info.memory),
                kv_tokens=info.kv_capacity_tokens, kv_bytes_per_token=info.kv_bytes_per_token,
                windowed_kv_bytes_per_token=info.windowed_kv_bytes_per_token,
                layers=c.num_layers, windowed_layers=c.num_windowed_layers,
                window=max(c.windows, default=0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker)), flush=True)
        return
    rows, table = [], []
    for name in args.models.split(","):
        proc = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True,
                              text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(name, "failed:", proc.stderr[-2000:], flush=True)
            continue
        r = json.loads(line[len("RESULT "):])
        m = r["memory"]
        full = r["kv_bytes_per_token"] - r["windowed_kv_bytes_per_token"]
        # a window-sized pool per windowed layer: only the global layers grow with tokens
        r["tokens_if_windowed_pool"] = m["kv_bytes"] // full if r["windowed_layers"] else None
        rows.append(r)
        table.append([name, m["weights_bytes"] / GIB, m["capture_bytes"] / 2**20,
                      m["kv_bytes"] / GIB, r["kv_tokens"], r["kv_bytes_per_token"],
                      r["windowed_kv_bytes_per_token"],
                      f"{r['windowed_layers']}/{r['layers']}" if r["windowed_layers"] else "0",
                      r["tokens_if_windowed_pool"] or "—", r["ready_s"]])
        print(r, flush=True)
    md = ("Start-up sizing, default settings, random weights of each shape (bf16; a `:fp8` "
          "row quantized at load, QUANTIZATION=fp8).\n\n"
          "`window-sized pool`: tokens the same KV bytes would hold if each windowed layer kept "
          "only its window (the global layers' bytes per token alone; the windows' own pages, "
          "window × prompts in flight, are left out).\n\n"
          + markdown_table(["model", "weights GiB", "capture MiB", "KV GiB", "KV tokens",
                            "KV bytes/token", "windowed layers' bytes/token", "windowed layers",
                            "tokens, window-sized pool", "ready s"], table))
    write_results(out_dir(), "sizing", run_meta(), {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
