"""Host cost of the pieces of one break, per call (microseconds of CPU time, GPU idle-bound).

What a breakable replay pays per layer on the host: one segment-graph replay, the KV-store
launch and the attention launch. Each is timed alone in a tight loop of N calls (the GPU work
is tiny, so the loop is host-bound), on the SmolLM2 shape at 16 tokens:
  graph_replay      torch.cuda.CUDAGraph.replay() of a one-kernel graph
  jit_store         the KV-store kernel through Triton's JIT launcher (kernel[grid](...))
  prepared_store    kv_store.prepare_store_kv's bound launch (what a break calls)
  prepared_attend   extend_attention.prepare_extend_attention's bound launch
  break_plan        AttentionBackend.plan(...)(layer): one whole break
(The device memory a captured graph holds is bench/graph_memory.py's: this script's earlier
per-node-count probe measured several graph sets in one process, and the driver reuses the
memory of destroyed graphs, so only its first figure meant anything.)
Usage: python bench/launch_overhead.py   (CUDA)  -> prints a table and writes launch.json to $OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import out_dir, run_meta  # noqa: E402
from kernels import extend_attention as attn_kernel  # noqa: E402
from kernels import kv_store  # noqa: E402
from service.engine.batch import SeqChunk, build_batch  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402
from service.model.attention import AttentionBackend  # noqa: E402
from service.model.config import preset  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6


def main() -> None:
    cfg = preset("smollm2-135m")
    dt, dev, t = torch.bfloat16, "cuda", 16
    pool = KVPool(cfg, 4096, 16, dt, dev)
    batch = build_batch([SeqChunk(tuple(range(t)), 0, tuple(pool.allocator.alloc(1)))],
                        pool.cache, dev)
    meta = batch.meta
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=dev, dtype=dt)
    out = torch.empty(t, h * d, device=dev, dtype=dt)
    backend = AttentionBackend("triton", h, kvh, d)
    q, k, v = backend.split(qkv)
    kc, vc = pool.cache.k[1], pool.cache.v[1]
    slots = meta.slot_mapping[:t]
    store = kv_store.prepare_store_kv(k, v, kc, vc, slots)
    attend, _, _ = attn_kernel.prepare_extend_attention(
        q, k, v, kc, vc, meta.cu_seqlens_q, meta.prefix_lens, meta.page_table, 16,
        meta.max_q_len, backend.scale, out.view(t, h, d))
    plan = backend.plan(qkv, meta, out)
    x = torch.zeros(16, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
        with torch.cuda.graph(g, stream=s):
            x.add_(1)
    torch.cuda.synchronize()
    rows = {
        "graph_replay": per_call_us(g.replay),
        "jit_store": per_call_us(lambda: kv_store.store_kv(k, v, kc, vc, slots)),
        "prepared_store": per_call_us(lambda: store(kc, vc)),
        "prepared_attend": per_call_us(lambda: attend(kc, vc)),
        "break_plan": per_call_us(lambda: plan(1)),
        "empty_python_call": per_call_us(lambda: None),
    }
    from kernels.launch import hooks_idle

    for name, us in rows.items():
        print(f"{name:18s} {us:7.2f} us/call")
    print(f"relauncher fast path on (no Triton launch hook): {hooks_idle()}")
    (out_dir() / "launch.json").write_text(json.dumps(
        {"meta": run_meta(), "us": rows, "fast_path_on": hooks_idle()}, indent=1))


if __name__ == "__main__":
    main()
