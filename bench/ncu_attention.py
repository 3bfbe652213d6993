"""One attention batch under Nsight Compute: cuDNN SDPA, the service's pick and the Hopper kernel
with looping CTAs, each warmed up, then launched once between profiler start and stop.
Usage (H200): ncu --clock-control none --profile-from-start off --section SpeedOfLight
  --section MemoryWorkloadAnalysis --section WarpStateStats python3 bench/ncu_attention.py
  [--batch 64x128] [--heads 32/8] [--head-dim 128]"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.attention import sdpa_kernel

p = argparse.ArgumentParser()
p.add_argument("--batch", default="64x128", help="N prompts x S rows")
p.add_argument("--heads", default="32/8")
p.add_argument("--head-dim", type=int, default=128)
args = p.parse_args()
sys.argv = sys.argv[:1]  # bench/attention.py parses sys.argv on import

import bench.attention as a  # noqa: E402
from kernels.extend_attention_sm90 import SM90_LOOP_CONFIG  # noqa: E402

n, S = (int(x) for x in args.batch.split("x"))
H, KVH = (int(x) for x in args.heads.split("/"))
D = args.head_dim
b = a.Paged([S] * n, [0] * n, H, KVH, D, 16, "cuda", torch.bfloat16, seed=1)
q4, k4, v4 = (x.view(n, S, -1, D).transpose(1, 2) for x in (b.q, b.k, b.v))
sdpa, how = a.sdpa_runner(a.BACKENDS["cudnn"], q4, k4, v4, is_causal=True)
runs = {"cudnn": sdpa, "service": lambda: b.run(None),
        "sm90-loop": lambda: b.run(SM90_LOOP_CONFIG)}
with sdpa_kernel(a.BACKENDS["cudnn"]):
    for f in runs.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in runs.values():
        f()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
print(f"profiled {', '.join(runs)} at {n} x {S}, {H}/{KVH} heads, D {D} (cuDNN: {how})")
