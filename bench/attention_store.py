"""The KV store fused into the attention kernel against a separate store launch, on the H200.

One prepared launch per layer either way (a graph break): `fused` is the attention kernel with
STORE_KV (each group's first head writes its q-block's new K/V rows after its output), `separate`
is kernels/kv_store.py then the attention kernel without it. Device time per layer from
do_bench_cudagraph (no host launch cost), plain (non-Hopper) kernel, prefix-free prompts, page
size 16; both must write the same output and the same cache bits.

Usage: python bench/attention_store.py
Writes attention_store.{json,md} to $OUT (default bench/results).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from kernels import extend_attention as ea  # noqa: E402
from kernels import kv_store  # noqa: E402

HEADS = [(32, 8, 64), (9, 3, 64), (14, 2, 64), (32, 8, 128)]  # Llama-1B, SmolLM2, Qwen, 8B
CASES = [(1, 8192), (8, 1024), (64, 128), (1, 1024), (1, 512), (1, 128)]  # (prompts, tokens)
PAGE = 16


def measure(h: int, kvh: int, d: int, bs: int, s: int) -> dict:
    import triton.testing

    t, dev, bf16 = bs * s, "cuda", torch.bfloat16
    q = torch.randn(t, h, d, device=dev, dtype=bf16)
    k, v = (torch.randn(t, kvh, d, device=dev, dtype=bf16) for _ in range(2))
    kc = torch.zeros(t + PAGE, kvh, d, device=dev, dtype=bf16)  # slot 0..t-1 + a spare page
    vc = torch.zeros_like(kc)
    cu = torch.arange(0, t + 1, s, device=dev, dtype=torch.int32)
    prefix = torch.zeros(bs, device=dev, dtype=torch.int32)
    table = torch.zeros(bs, s // PAGE + 1, device=dev, dtype=torch.int32)  # no prefix: unread
    slots = torch.arange(t, device=dev, dtype=torch.int64)
    row, outs = dict(heads=f"{h}/{kvh}", d=d, case=f"{bs}x{s}"), {}
    for name in ("separate", "fused"):
        out = torch.empty_like(q)
        attend, _, _ = ea.prepare_extend_attention(
            q, k, v, kc, vc, cu, prefix, table, PAGE, s, None, out,
            store_slots=slots if name == "fused" else None, max_prefix_len=0)
        if name == "separate":
            store = kv_store.prepare_store_kv(k, v, kc, vc, slots)

            def fn(store=store, attend=attend) -> None:
                store(kc, vc)
                attend(kc, vc)
        else:
            def fn(attend=attend) -> None:
                attend(kc, vc)
        kc.zero_()
        vc.zero_()
        fn()
        torch.cuda.synchronize()
        outs[name] = (out.clone(), kc.clone(), vc.clone())
        row[f"{name}_us"] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
    row["same_bits"] = all(torch.equal(a, b) for a, b in zip(outs["separate"], outs["fused"]))
    return row


def main() -> None:
    meta = run_meta()
    rows = []
    for h, kvh, d in HEADS:
        for bs, s in CASES:
            rows.append(measure(h, kvh, d, bs, s))
            print(rows[-1], flush=True)
    md = markdown_table(["heads q/kv", "D", "case", "separate us", "fused us", "same bits"],
                        [[r["heads"], r["d"], r["case"], r["separate_us"], r["fused_us"],
                          r["same_bits"]] for r in rows])
    write_results(out_dir(), "attention_store", meta, {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
