"""The layer-indexed GEMM (kernels/linear.py) against cuBLAS (torch.mm) on the linears of real
model shapes at the row counts of the buckets it serves; graph-replay timings (device time).

For each (model, linear, M): cuBLAS, our kernel with `pick_tiles`, and the best of a small grid
of other tiles, so the tile rule can be checked and re-tuned on a new GPU.

Usage: python3 bench/indexed_linear.py [--models smollm2-135m,...] [--rows 16,64,256]
Writes indexed_linear.json / indexed_linear.md to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import markdown_table, out_dir, relerr, run_meta, write_results  # noqa: E402
from kernels.linear import indexed_linear, pick_tiles  # noqa: E402
from service.model.config import preset  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
GRID = [(bn, bk, st) for bn, bk, st in itertools.product((32, 64, 128), (64, 128), (3, 4))]


def shapes(name: str) -> list[tuple[str, int, int]]:
    c = preset(name)
    h, f = c.hidden_size, c.intermediate_size
    return [("qkv", c.q_size + 2 * c.kv_size, h), ("o", h, c.q_size), ("gate_up", 2 * f, h),
            ("down", h, f)]


def us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--layers", type=int, default=4, help="stack depth (the index is 2)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in args.models.split(","):
        for lin, n, k in shapes(name):
            w = torch.randn(args.layers, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            idx = torch.tensor([1], device="cuda", dtype=torch.int32)
            for m in (int(x) for x in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ref = torch.empty_like(out)
                cublas = us(lambda x=x, w=w, ref=ref: torch.mm(x, w[2].t(), out=ref))
                tiles = pick_tiles(m, n, k, sms)
                err = relerr(indexed_linear(x, w, None, idx, 1, out, tiles=tiles), x @ w[2].t())

                def ours_fn(t, x=x, w=w, idx=idx, out=out):
                    return indexed_linear(x, w, None, idx, 1, out, tiles=t)

                ours = us(lambda: ours_fn(tiles))  # noqa: B023 - timed before the loop moves on
                best, best_t = ours, tiles
                for bn, bk, st in GRID:
                    t = (tiles[0], bn, bk, 4, st)
                    if t == tiles:
                        continue
                    v = us(lambda t=t: ours_fn(t))  # noqa: B023 - timed here
                    if v < best:
                        best, best_t = v, t
                row = dict(model=name, linear=lin, M=m, N=n, K=k, cublas_us=cublas, ours_us=ours,
                           tiles=list(tiles), best_us=best, best_tiles=list(best_t), relerr=err)
                print(row, flush=True)
                rows.append(row)
    header = ["model", "linear", "M", "N", "K", "cuBLAS µs", "ours µs", "ours/cuBLAS", "tiles",
              "best µs", "best tiles", "relerr"]
    table = markdown_table(header, [[r["model"], r["linear"], r["M"], r["N"], r["K"],
                                     r["cublas_us"], r["ours_us"], r["ours_us"] / r["cublas_us"],
                                     r["tiles"], r["best_us"], r["best_tiles"], r["relerr"]]
                                    for r in rows])
    write_results(out_dir(), "indexed_linear", run_meta(), {"rows": rows},
                  "Layer-indexed GEMM vs cuBLAS, graph replay (device time).\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
