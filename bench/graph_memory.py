"""What one captured segment graph costs in device memory outside the allocator, and why.

Captures the same step many times (one shared pool, as the runner does) and divides the drop
in free device memory, minus the allocator's growth, by the number of graphs. Steps: a real
SmolLM2-135M segment (post of one layer + pre of the next) at a few bucket sizes, its GEMMs
alone, its Triton kernels alone, single kernels of each kind. Also counts the kernels one
eager run of each step launches (torch profiler), so per-graph and per-node costs can be
told apart. Second part: whether `torch._grouped_mm` can select one layer's weight from a
stacked (L, N, K) tensor by a device-side index (zero-row groups), at what speed vs torch.mm.

NOTE: only the first step measured in a process is a clean figure. The driver keeps the memory
of destroyed graphs and hands it to later graphs, so after the first step's graphs are freed the
next steps read ~0 (seen on the H200: 130 KB/graph for the first step, ~0 for all later ones).
Measure one step per process: `--steps segment`, then `--steps gemms`, and so on.

Usage: python3 bench/graph_memory.py [--graphs 300] [--steps segment,gemms] [--tokens 16]
       (CUDA only; ~1 minute on an H200 for every step)
Writes graph_memory.json to $OUT (default bench/results) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import out_dir, relerr, run_meta  # noqa: E402
from kernels import ops  # noqa: E402
from service.engine.buffers import StaticBuffers  # noqa: E402
from service.engine.dp import mlp_width  # noqa: E402
from service.model.config import preset  # noqa: E402
from service.model.loader import random_model  # noqa: E402


def kernels_launched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA"
               and "Memcpy" not in e.name and "Memset" not in e.name)


def per_graph(fn, graphs: int, stream: torch.cuda.Stream) -> dict:
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        fn()  # warm-up: kernels loaded, cuBLAS choices made
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    f0, r0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    keep = []
    for _ in range(graphs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            fn()
        keep.append(g)
    torch.cuda.synchronize()
    f1, r1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    keep[0].replay()
    torch.cuda.synchronize()
    f2 = torch.cuda.mem_get_info()[0]
    for g in keep:
        g.reset()
    del keep
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return dict(kb_per_graph=(f0 - f1 - (r1 - r0)) / graphs / 1024,
                pool_kb=(r1 - r0) / 1024, first_replay_kb=(f1 - f2) / 1024)


def segment_steps(model, bufs: StaticBuffers, n: int, layer: int) -> dict:
    v = bufs.views(n)
    lay, nxt, m = model.layers[layer], model.layers[layer + 1], model

    def segment():
        lay.post(v.attn, v.residual, h_out=v.hidden, scratch=v.mlp_scratch)
        nxt.pre(v.hidden, v.residual, v.positions, m.cos_sin, qkv_out=v.qkv)

    mlp = v.mlp_scratch
    f = mlp.shape[1] // 2

    def gemms():
        torch.mm(v.attn, lay.o_proj.weight.t(), out=v.hidden)
        torch.mm(v.hidden, lay.mlp.gate_up_proj.weight.t(), out=mlp)
        torch.mm(mlp[:, :f], lay.mlp.down_proj.weight.t(), out=v.hidden)
        torch.mm(v.hidden, nxt.qkv_proj.weight.t(), out=v.qkv)

    def tritons():
        ops.fused_add_rms_norm(v.hidden, v.residual, lay.post_attention_layernorm.weight, 1e-5,
                               use_triton=True)
        ops.silu_and_mul(mlp, out=mlp[:, :f], use_triton=True)
        ops.fused_add_rms_norm(v.hidden, v.residual, nxt.input_layernorm.weight, 1e-5,
                               use_triton=True)
        c = model.cfg
        q = v.qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = v.qkv[:, c.q_size: c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        ops.apply_rope(q, k, v.positions, m.cos_sin, use_triton=True)

    def one_triton():
        ops.rms_norm(v.residual, lay.input_layernorm.weight, 1e-5, out=v.hidden, use_triton=True)

    def one_mm():
        torch.mm(v.attn, lay.o_proj.weight.t(), out=v.hidden)

    def one_add():
        torch.add(v.residual, v.hidden, out=v.hidden)

    def eight_adds():
        for _ in range(8):
            torch.add(v.residual, v.hidden, out=v.hidden)

    return dict(segment=segment, gemms=gemms, tritons=tritons, one_triton=one_triton,
                one_mm=one_mm, one_add=one_add, eight_adds=eight_adds)


def grouped_mm_probe(model, sizes=(16, 128, 512, 2048, 8192)) -> list[dict]:
    """y = x @ W[c]^T with c on the device, via torch._grouped_mm over all layers' weights."""
    import triton.testing

    if not hasattr(torch, "_grouped_mm"):
        return [dict(error="torch._grouped_mm missing")]
    out = []
    layers = model.layers
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        mods = [getattr(lay.mlp if "gate" in name or "down" in name else lay, name)
                for lay in layers]
        w = torch.stack([mm.weight for mm in mods])  # (L, N, K)
        L, N, K = w.shape
        for M in sizes:
            x = torch.randn(M, K, device="cuda", dtype=w.dtype)
            c = torch.tensor(L // 2, device="cuda", dtype=torch.int32)
            ar = torch.arange(L, device="cuda", dtype=torch.int32)
            y = torch.empty(M, N, device="cuda", dtype=w.dtype)

            def gm(x=x, w=w, ar=ar, c=c, M=M):
                offs = (ar >= c).to(torch.int32) * M
                return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

            def mm(x=x, w=w, L=L, y=y):
                return torch.mm(x, w[L // 2].t(), out=y)

            row = dict(weight=name, M=M, N=N, K=K)
            try:
                err = relerr(gm(), mm())
                row.update(relerr=err,
                           grouped_us=1e3 * triton.testing.do_bench_cudagraph(gm, rep=50),
                           mm_us=1e3 * triton.testing.do_bench_cudagraph(mm, rep=50))
            except Exception as e:  # noqa: BLE001 - report what failed and go on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(row, flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", type=int, default=300)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", default="segment,gemms,tritons,one_triton,one_mm,one_add,"
                    "eight_adds", help="in this order; only the first is a clean figure")
    ap.add_argument("--tokens", default="16,1024,8192")
    ap.add_argument("--no-grouped-mm", action="store_true")
    args = ap.parse_args()
    wanted = args.steps.split(",")
    torch.zeros(1, device="cuda")
    cfg = preset(args.model)
    model = random_model(cfg, torch.device("cuda"), torch.bfloat16)
    model.set_kernels(True)
    stream = torch.cuda.Stream()
    bufs = StaticBuffers.allocate(cfg, 8192, torch.bfloat16, torch.device("cuda"),
                                  mlp_width(model))
    rows = []
    with torch.inference_mode():
        for n in (int(t) for t in args.tokens.split(",")):
            steps = segment_steps(model, bufs, n, 3)
            for name in wanted:
                fn = steps[name]
                with torch.cuda.stream(stream):
                    nodes = kernels_launched(fn)
                r = dict(step=name, tokens=n, kernels=nodes, **per_graph(fn, args.graphs, stream))
                print(f"{name:11s} n={n:5d} kernels={nodes:3d} {r['kb_per_graph']:8.1f} KB/graph"
                      f" (pool +{r['pool_kb']:.0f} KB, first replay "
                      f"+{r['first_replay_kb']:.0f} KB)", flush=True)
                rows.append(r)
        gm = [] if args.no_grouped_mm else grouped_mm_probe(model)
    path = out_dir() / "graph_memory.json"
    path.write_text(json.dumps({"meta": run_meta(), "graphs": args.graphs, "steps": rows,
                                "grouped_mm": gm}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
