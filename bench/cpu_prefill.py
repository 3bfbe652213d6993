"""CPU numbers for the default model: load time and prefill time of 128- and 1,024-token prompts.

Usage: python bench/cpu_prefill.py   (prints a markdown table; no GPU needed)
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.engine.batch import SeqChunk, build_batch  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.loader import load_model  # noqa: E402


def main() -> None:
    loaded = load_model(None, "cpu", torch.float32)
    model, cfg = loaded.model, loaded.cfg
    pool = KVPool(cfg, 4096, 16, torch.float32, "cpu")
    rows = [f"| load (GGUF dequantize + build) | {loaded.load_seconds * 1000:.0f} ms |"]
    g = torch.Generator().manual_seed(0)
    for n in (128, 1024):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        pages = pool.allocator.alloc(pages_for(n, 16))
        batch = build_batch([SeqChunk(tuple(ids), 0, tuple(pages))], pool.cache, "cpu")
        times = []
        with torch.inference_mode():
            for _ in range(4):
                t0 = time.perf_counter()
                model(batch.input_ids, batch.positions, batch.meta)
                times.append(time.perf_counter() - t0)
        pool.allocator.free(pages)
        rows.append(f"| prefill {n} tokens (median of 3 after warm-up) | "
                    f"{statistics.median(times[1:]) * 1000:.0f} ms |")
    print(f"SmolLM2-135M-Instruct, fp32, CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}\n")
    print("| what | time |\n|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
