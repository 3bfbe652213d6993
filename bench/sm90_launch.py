"""The Hopper kernel's launch shapes side by side, the evidence for `pick_sm90`: one CTA per
tile, CTAs looping over tiles with one and with two Q slots, the Triton kernel with the config the
service picks for the batch (`pick_config`) and cuDNN SDPA (equal-length batches only), each
timed in a CUDA graph (TFLOP/s), and which of them the service runs (`pick_sm90`), over batches
of 1-128 prompts of 128-2,048 rows and three varlen batches, at the heads of the real models
(D128 32/8, 16/2; D64 32/8, 14/2, 9/3). D64 rows skip one CTA per tile (the service never takes
it there) and the few-sequence shapes.

Usage (H200): python3 bench/sm90_launch.py                     -> $OUT/sm90-launch.{json,md,png}
              python3 bench/sm90_launch.py --rows raw.json     (tables and plot from saved rows)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    bench_ms,
    markdown_table,
    out_dir,
    pyplot,
    run_meta,
    write_results,
)

SHAPES = [(1, 1024), (1, 2048), (2, 1024), (4, 512), (4, 1024), (8, 512), (16, 128), (32, 128),
          (64, 128), (128, 128), (32, 256), (64, 256), (16, 512), (32, 512), (8, 1024),
          (16, 1024)]
HEADS = [(9, 3, 64), (14, 2, 64), (32, 8, 128), (16, 2, 128), (32, 8, 64)]
KERNELS = ("triton", "one", "loop", "loop-q2", "cudnn")


def varlens() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {"64 x 100-1000": [rng.randint(100, 1000) for _ in range(64)],
            "64 x 100-4000": [rng.randint(100, 4000) for _ in range(64)],
            "32 x 64-512": [rng.randint(64, 512) for _ in range(32)]}


def measure() -> list[dict]:
    from torch.nn.attention import sdpa_kernel

    sys.argv = sys.argv[:1]  # bench/attention.py parses sys.argv on import
    import bench.attention as a
    from kernels.extend_attention_config import pick_config
    from kernels.extend_attention_sm90 import (
        SM90_CONFIG,
        SM90_LOOP_CONFIG,
        SM90_LOOP_Q2_CONFIGS,
        pick_sm90,
    )

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = {SM90_CONFIG: "one", SM90_LOOP_CONFIG: "loop", SM90_LOOP_Q2_CONFIGS[64]: "loop-q2",
             SM90_LOOP_Q2_CONFIGS[128]: "loop-q2", None: "triton"}

    rows = []
    for H, KVH, D in HEADS:
        cases = [(f"{n} x {S}", [S] * n) for n, S in SHAPES
                 if D == 128 or (S >= 512 and n >= 4) or n >= 64 or S == 256]
        for name, qlens in cases + list(varlens().items()):
            b = a.Paged(qlens, [0] * len(qlens), H, KVH, D, 16, "cuda", torch.bfloat16, seed=1)
            flops = sum(4 * s * s * D * H / 2 for s in qlens)
            row = dict(H=H, KVH=KVH, D=D, batch=name,
                       pick=names[pick_sm90(len(qlens), H, max(qlens), sms, D)])
            triton = pick_config(D, b.q.dtype, b.q.device, max(qlens), 0, H // KVH)
            runs = {"triton": lambda b=b, c=triton: b.run(c),
                    "loop": lambda b=b: b.run(SM90_LOOP_CONFIG),
                    "loop-q2": lambda b=b, c=SM90_LOOP_Q2_CONFIGS[D]: b.run(c)}
            if D == 128:
                runs["one"] = lambda b=b: b.run(SM90_CONFIG)
            if len(set(qlens)) == 1:
                n, S = len(qlens), qlens[0]
                q4, k4, v4 = (x.view(n, S, -1, D).transpose(1, 2) for x in (b.q, b.k, b.v))
                runs["cudnn"], _ = a.sdpa_runner(a.BACKENDS["cudnn"], q4, k4, v4, is_causal=True)
            for kernel, fn in runs.items():
                with sdpa_kernel(a.BACKENDS["cudnn"]):
                    try:
                        ms = bench_ms(fn, True, rep_ms=40, graph=True)
                        row[kernel] = round(flops / ms / 1e9, 1)
                    except Exception as e:  # a kernel that does not take this shape
                        row[kernel] = f"{type(e).__name__}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    parts = []
    for H, KVH, D in dict.fromkeys((r["H"], r["KVH"], r["D"]) for r in rows):
        sel = [r for r in rows if (r["H"], r["KVH"], r["D"]) == (H, KVH, D)]
        parts.append(f"## {H}/{KVH} heads, D{D} (TFLOP/s in a graph)\n\n" + markdown_table(
            ["batch", "Triton (service config)", "one CTA per tile", "looping CTAs",
             "looping, 2 Q slots", "cuDNN", "the service runs"],
            [[r["batch"], *(r.get(k) for k in KERNELS), r.get("pick")] for r in sel]))
    return "\n\n".join(parts)


def plot(rows: list[dict], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    groups = list(dict.fromkeys((r["H"], r["KVH"], r["D"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 5), squeeze=False)
    for ax, g in zip(axes[0], groups):
        sel = [r for r in rows if (r["H"], r["KVH"], r["D"]) == g]
        x = range(len(sel))
        for kernel in KERNELS:
            ys = [r.get(kernel) if isinstance(r.get(kernel), float) else None for r in sel]
            if any(y is not None for y in ys):
                ax.plot(x, [float("nan") if y is None else y for y in ys], marker="o",
                        label=kernel)
        ax.set_xticks(list(x), [r["batch"] for r in sel], rotation=70, fontsize=7)
        ax.set_ylabel("TFLOP/s (graph)")
        ax.set_title(f"{g[0]}/{g[1]} heads, D{g[2]}, bf16")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, help="rows saved by an earlier run (a JSON list)")
    parser.add_argument("--name", default="sm90-launch")
    args = parser.parse_args()
    if args.rows:
        saved = json.loads(args.rows.read_text())
        meta, rows = ((saved.get("meta", {}), saved["rows"]) if isinstance(saved, dict)
                      else ({}, saved))
    else:
        assert torch.cuda.is_available(), "needs a Hopper GPU"
        meta, rows = run_meta(), measure()
    out = out_dir()
    write_results(out, args.name, meta, {"rows": rows}, report(rows))
    print(plot(rows, out / f"{args.name}.png"))


if __name__ == "__main__":
    main()
