"""FOLD_NORMS on vs off, interleaved: two engines on the same weights, timed in alternation.

bench/e2e.py runs its variants one after another, so a slow drift of the GPU's clocks (or of
the host) between variants reads as a difference between them. Here both engines live at
once and each round times every case on one, then the other; the medians over rounds are
compared, with each variant's top kernels (torch profiler) for one case.

Usage: python bench/fold_ab.py [--models llama-3.2-1b] [--rounds 5]
Writes fold_ab.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from bench.e2e import CASES, engine_cfg, profile, timed  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

VARIANTS = ("unfolded", "folded")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    meta = run_meta()
    rows, profiles, raw = [], [], {}
    for name in args.models.split(","):
        cfg = preset(name)
        model = random_model(cfg, "cuda", torch.bfloat16)
        engines = {}
        for v, m in (("unfolded", copy.deepcopy(model)), ("folded", model)):
            engines[v] = EngineCore(engine_cfg(True, fold=v == "folded"),
                                    loaded=LoadedModel(m, None, cfg, Path(name), 0.0))
        assert engines["folded"].model.norms_folded
        assert not engines["unfolded"].model.norms_folded
        gen = torch.Generator().manual_seed(0)
        chunks = {}
        for bs, s in CASES:
            ids = torch.randint(0, cfg.vocab_size, (bs, s), generator=gen).tolist()
            for v, e in engines.items():
                pages = [e.pool.allocator.alloc(pages_for(s, 16)) for _ in range(bs)]
                chunks[v, bs, s] = [SeqChunk(tuple(x), 0, tuple(p)) for x, p in zip(ids, pages)]
        times = {(v, bs, s): [] for v in VARIANTS for bs, s in CASES}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for bs, s in CASES:
                for v in order:
                    e, c = engines[v], chunks[v, bs, s]
                    times[v, bs, s].append(timed(lambda e=e, c=c: e.forward(c),
                                                 20 if bs * s <= 1024 else 5))
        for bs, s in CASES:
            a, b = (statistics.median(times[v, bs, s]) for v in VARIANTS)
            rows.append([name, f"{bs}x{s}", round(a, 3), round(b, 3), f"{a / b:.3f}"])
            raw[f"{name} {bs}x{s}"] = {v: times[v, bs, s] for v in VARIANTS}
            print(rows[-1], flush=True)
        for v, e in engines.items():
            profiles.append(profile(e.forward, chunks[v, 8, 1024], f"{name} {v} 8x1024"))
        for e in engines.values():
            e.close()
        del engines, model
        torch.cuda.empty_cache()
    md = (f"Median over {args.rounds} interleaved rounds of each round's median forward ms "
          "(EngineCore.forward, graphs on, as bench/e2e.py times it).\n\n"
          + markdown_table(["model", "case", "unfolded ms", "folded ms", "unfolded/folded"],
                           rows))
    for p in profiles:
        md += (f"\n\n### {p['label']}: kernels {p['kernel_ms']:.2f} ms in {p['launches']} "
               "launches\n\n" + markdown_table(["kernel", "ms", "calls"],
                                               [[k["name"], k["ms"], k["calls"]]
                                                for k in p["top"][:8]]))
    write_results(out_dir(), "fold_ab", meta, {"rows": rows, "raw": raw, "profiles": profiles},
                  md)
    print(md)


if __name__ == "__main__":
    main()
