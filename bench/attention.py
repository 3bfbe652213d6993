"""Extend attention (ours) against PyTorch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION, bf16.

"ours-table" is what the service runs for one call: on a Hopper GPU the warp-specialized Gluon
kernel (kernels/extend_attention_sm90.py) for prefix-free head_dim-128 batches of >= 4096 rows in
sequences of >= 512, the plain Triton kernel (kernels/extend_attention.py, its config by rows a
sequence and prefix) otherwise; "ours-sm90" and "ours-triton" (the table config) force one.

Cases: causal single sequences (S = 512 .. 16k, head_dim 64/128, 32q/8kv and 16q/2kv heads);
batches of equal short prompts (64 x 128, 16 x 512, 8 x 1k) that SDPA takes as one call; a
varlen batch of 64 prompts (lengths uniform in 100..4000, seed 0) that SDPA runs padded (is_causal
is exact on right-padded rows, so no mask is needed; the pad/unpad copies are timed) and as a
per-sequence loop; an extend case (1k new tokens on an 8k cached prefix, page size 16 and 1) that
SDPA runs on contiguous K/V with a lower-right causal mask (the page gather it would need first is
timed separately); Gemma 3 1B's local layers (4q/1kv heads, head_dim 256, a 512-key window, S = 1k
.. 16k) windowed against causal, SDPA causal for reference. SDPA gets GQA through enable_gqa=True
where the backend takes it, otherwise
K/V repeated per query head outside the timing (each row says which). A few configs of our kernels
run side by side so the config tables can be picked from one run.

Usage: python bench/attention.py             # one GPU, < 6 minutes on an H200
       python bench/attention.py --cases varlen --repeats 3   # a subset, repeated in one process
       python bench/attention.py --dry-run   # tiniest cases on the CPU via Triton's interpreter
Writes attention.json, attention.md and attention.png to $OUT (default bench/results) and prints
the markdown last.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from bench.common import (  # noqa: E402
    bench_ms,
    markdown_table,
    out_dir,
    pyplot,
    relerr,
    run_meta,
    write_results,
)
from kernels import ops  # noqa: E402
from kernels.extend_attention import (  # noqa: E402
    INTERPRETER_CONFIG,
    AttnConfig,
    VarlenBatch,
    extend_attention,
    extend_attention_ref,
    pick_config,
    prepare_extend_attention,
)
from kernels.extend_attention_sm90 import (  # noqa: E402
    SM90_CONFIG,
    SM90_LOOP_CONFIG,
    Sm90Config,
    extend_attention_sm90,
)

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
A, G = AttnConfig, Sm90Config
TRITON = "triton"  # the plain Triton kernel with its table config, wherever "table" would not
# Variants of our kernels, timed side by side with what the service runs ("table": the Hopper
# kernel of kernels/extend_attention_sm90.py for prefix-free head_dim-128 batches of >= 4096
# rows, the plain Triton kernel with its table config otherwise). Sm90Config variants run the
# Hopper kernel at any size; AttnConfig variants the plain kernel (TMA at every size).
VARIANTS = {
    "triton": TRITON,
    "sm90-qblocks-first": G(heads_first=False),
    "m128n128w8s2-tma": A(128, 128, 8, 2, use_tma=True, tma_min_tokens=0),
}


# The Hopper kernel on short sequences: one CTA per tile against CTAs that loop over tiles
SM90_SHORT_VARIANTS = {
    "sm90": SM90_CONFIG,
    "sm90-persistent": SM90_LOOP_CONFIG,
}


def variants(dry: bool, head_dim: int = 128) -> dict:
    if dry:
        return {"table": INTERPRETER_CONFIG, "interp-m32-hf": A(32, 16, 4, 1, heads_first=True)}
    names = dict(VARIANTS)
    if head_dim != 128:  # the Hopper kernel serves head_dim 128 only (slower at 64)
        names = {k: v for k, v in names.items() if not isinstance(v, Sm90Config)}
    return {"table": None, **names}


class Paged:
    """Our inputs for a batch: new tokens token-major, prefixes in a pool of scattered pages."""

    def __init__(self, qlens, plens, H, KVH, D, page_size, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        T = sum(qlens)
        rnd = lambda *shape: torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        self.q, self.k, self.v = rnd(T, H, D), rnd(T, KVH, D), rnd(T, KVH, D)
        n_pages = [-(-p // page_size) for p in plens]
        total = sum(n_pages) + 1
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
        self.page_table = torch.zeros((len(qlens), max(n_pages + [1])), dtype=torch.int32)
        for b, n in enumerate(n_pages):
            self.page_table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.page_table = self.page_table.to(device)
        self.k_cache = rnd(total * page_size, KVH, D)
        self.v_cache = rnd(total * page_size, KVH, D)
        self.cu = torch.tensor([0, *qlens], device=device).cumsum(0).to(torch.int32)
        self.prefix = torch.tensor(plens, dtype=torch.int32, device=device)
        self.qlens, self.plens, self.page_size = qlens, plens, page_size
        self.out = torch.empty_like(self.q)
        # with the host-side facts the service passes
        self.varlen = VarlenBatch(self.cu, self.prefix, self.page_table, page_size, max(qlens),
                                  max_prefix_len=max(plens), num_tokens=sum(qlens))

    def slots(self, b: int) -> torch.Tensor:
        pos = torch.arange(self.plens[b], device=self.q.device)
        return (
            self.page_table[b, pos // self.page_size].long() * self.page_size + pos % self.page_size
        )

    def run(self, config=None, window=None):
        if isinstance(config, Sm90Config):
            return extend_attention_sm90(self.q, self.k, self.v, self.varlen, out=self.out,
                                         config=config)
        if config == TRITON:
            config = pick_config(self.q.shape[2], self.q.dtype, self.q.device)
        return extend_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, self.varlen,
                                out=self.out, config=config, window=window)


def sdpa_runner(backend, q, k, v, **kw):
    """(fn, how) for the first SDPA form this backend accepts, or (None, error)."""
    group = q.shape[1] // k.shape[1]
    rep = lambda x: x.repeat_interleave(group, 1)
    forms = [("enable_gqa", q, k, v, True), ("enable_gqa, contiguous", *_contig(q, k, v), True)]
    forms.append(("repeat_kv", *_contig(q, rep(k), rep(v)), False))
    error = "unsupported"
    for how, qq, kk, vv, gqa in forms:
        extra = {"enable_gqa": True} if gqa and group > 1 else {}
        fn = lambda qq=qq, kk=kk, vv=vv, extra=extra: F.scaled_dot_product_attention(
            qq, kk, vv, **kw, **extra
        )
        try:
            with sdpa_kernel(backend):
                fn()
            return fn, how
        except (RuntimeError, ValueError, NotImplementedError) as e:
            error = f"unsupported: {str(e).splitlines()[0][:120]}"
    return None, error


def _contig(*xs):
    return tuple(x.contiguous() for x in xs)


GRAPH_MAX_S = 2048  # at or below this causal length, also time CUDA-graph replays (no host cost)


def timed_sdpa(name, make_fn, cuda, graph=False):
    """Times SDPA under one backend; returns (ms or None, how, output or None, graph ms)."""
    fn, how = make_fn(BACKENDS[name])
    if fn is None:
        return None, how, None, None
    with sdpa_kernel(BACKENDS[name]):
        out = fn()
        ms_graph = bench_ms(fn, cuda, graph=True) if graph and cuda else None
        return bench_ms(fn, cuda), how, out, ms_graph


class Rows(list):
    """Result rows; each is printed as it lands, so a cut-off run still shows its progress."""

    def append(self, row: dict) -> None:
        tf = row.get("tflops")
        print(
            f"{row['case']:7} H={row.get('H')}/{row.get('KVH')} D={row.get('D')} "
            f"S={row.get('S')} page={row.get('page_size')} {row['kernel']:28} "
            f"{'-' if tf is None else f'{tf:7.1f} TFLOP/s'}  {row.get('how', '')[:90]}",
            flush=True,
        )
        super().append(row)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / ms / 1e9


def causal_cases(args, cuda, device, dtype, rows):
    seqs = [64] if args.dry_run else [512, 1024, 2048, 4096, 8192, 16384]
    if getattr(args, "small", False):
        seqs = [512, 1024]
    dims = [64] if args.dry_run else [64, 128]
    heads = [(4, 2)] if args.dry_run else [(32, 8), (16, 2)]
    sweep = seqs[-1:] if args.dry_run else [4096, 16384]
    for H, KVH in heads:
        for D in dims:
            for S in seqs:
                batch = Paged([S], [0], H, KVH, D, 16, device, dtype, seed=S + D)
                flops = 4 * S * S * D * H / 2
                info = dict(case="causal", H=H, KVH=KVH, D=D, S=S)
                graph = S <= GRAPH_MAX_S
                q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (batch.q, batch.k, batch.v))
                make = lambda b, q4=q4, k4=k4, v4=v4: sdpa_runner(b, q4, k4, v4, is_causal=True)
                ref = None
                for name in BACKENDS:
                    ms, how, out, ms_graph = timed_sdpa(name, make, cuda, graph=graph)
                    if out is not None and ref is None:
                        ref = out[0].transpose(0, 1)
                    rows.append(dict(info, kernel=f"sdpa-{name}", ms=ms, tflops=tflops(flops, ms),
                                     ms_graph=ms_graph, tflops_graph=tflops(flops, ms_graph),
                                     how=how))  # fmt: skip
                if (H, KVH) == heads[0] and S in sweep:
                    names = variants(args.dry_run, D)
                elif not cuda:
                    names = {"table": INTERPRETER_CONFIG}
                else:  # the service's pick, and at D=128 the Hopper kernel at every S
                    names = {"table": None, **({"sm90": SM90_CONFIG} if D == 128 else {}),
                             **({"sm90-persistent": SM90_LOOP_CONFIG} if S <= 2048 else {}),
                             **({"triton": TRITON} if D == 128 and S >= 4096 else {})}
                for vname, cfg in names.items():
                    rows.append(ours_row(batch, cfg, vname, flops, ref, cuda, info, graph=graph))


def ours_row(batch: Paged, cfg, vname, flops, ref, cuda, info, graph=False, window=None) -> dict:
    row = dict(info, kernel=f"ours-{vname}")
    try:
        out = batch.run(cfg, window).clone()
        row["ms"] = bench_ms(lambda: batch.run(cfg, window), cuda)
        row["tflops"] = tflops(flops, row["ms"])
        if graph and cuda:
            row["ms_graph"] = bench_ms(lambda: batch.run(cfg, window), cuda, graph=True)
            row["tflops_graph"] = tflops(flops, row["ms_graph"])
        row["how"] = "one launch"
        if ref is not None:
            row["relerr_vs_sdpa"] = relerr(out, ref)
    except Exception as e:  # a config that does not compile (e.g. out of shared memory)
        row.update(ms=None, tflops=None, how=f"failed: {type(e).__name__}: {str(e)[:120]}")
    return row


def varlen_case(args, cuda, device, dtype, rows):
    rng = random.Random(0)
    n, lo, hi = (3, 20, 60) if args.dry_run else (64, 100, 4000)
    H, KVH, D = (4, 2, 64) if args.dry_run else (32, 8, 128)
    qlens = [rng.randint(lo, hi) for _ in range(n)]
    batch = Paged(qlens, [0] * n, H, KVH, D, 16, device, dtype, seed=1)
    flops = sum(4 * s * s * D * H / 2 for s in qlens)
    info = dict(case="varlen", H=H, KVH=KVH, D=D, S=f"{n} prompts, {lo}-{hi}")
    smax, T, cu = max(qlens), sum(qlens), batch.cu.tolist()
    lens = torch.tensor(qlens, device=device)
    seq_idx = torch.repeat_interleave(torch.arange(n, device=device), lens)  # (T,)
    pos_idx = torch.arange(T, device=device) - batch.cu[:-1].long()[seq_idx]  # (T,)

    def pad(x):  # (T, heads, D) -> (n, heads, smax, D), zero right padding
        buf = x.new_zeros((n, smax, x.shape[1], D))
        buf[seq_idx, pos_idx] = x
        return buf.transpose(1, 2)

    def padded(backend):
        probe, how = sdpa_runner(backend, pad(batch.q), pad(batch.k), pad(batch.v), is_causal=True)
        if probe is None:
            return None, how

        def fn():  # pad, attend, unpad: all inside the timing
            qp, kp, vp = pad(batch.q), pad(batch.k), pad(batch.v)
            if how.startswith("repeat"):
                kp, vp = kp.repeat_interleave(H // KVH, 1), vp.repeat_interleave(H // KVH, 1)
            kw = {"enable_gqa": True} if how.startswith("enable_gqa") else {}
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, **kw)
            return o.transpose(1, 2)[seq_idx, pos_idx]

        return fn, f"padded to {smax}, no mask (causal is exact on right padding), {how}"

    def loop(backend):
        views = [
            tuple(x[cu[b] : cu[b + 1]].transpose(0, 1)[None] for x in (batch.q, batch.k, batch.v))
            for b in range(n)
        ]
        probe, how = sdpa_runner(backend, *views[0], is_causal=True)
        if probe is None:
            return None, how
        kw = {"enable_gqa": True} if how.startswith("enable_gqa") else {}
        out = torch.empty_like(batch.q)

        def fn():
            for b, (qb, kb, vb) in enumerate(views):
                if how.startswith("repeat"):
                    kb, vb = kb.repeat_interleave(H // KVH, 1), vb.repeat_interleave(H // KVH, 1)
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, **kw)
                out[cu[b] : cu[b + 1]] = o[0].transpose(0, 1)
            return out

        return fn, f"{n} launches, {how}"

    ref = None
    for name in BACKENDS:
        for label, make in (("padded", padded), ("loop", loop)):
            ms, how, out, _ = timed_sdpa(name, make, cuda)
            if out is not None and ref is None:
                ref = out
            rows.append(
                dict(info, kernel=f"sdpa-{name}-{label}", ms=ms, tflops=tflops(flops, ms), how=how)
            )
    for vname, cfg in variants(args.dry_run).items():
        rows.append(ours_row(batch, cfg, vname, flops, ref, cuda, info))


def short_cases(args, cuda, device, dtype, rows):
    """Batches of equal short prompts (B x S = 8,192 rows): SDPA takes them as one (B, H, S, D)
    call; ours as the service binds them (row count and prefix-freedom known)."""
    shapes = [(3, 16)] if args.dry_run else [(64, 128), (16, 512), (8, 1024)]
    dims = [64] if args.dry_run else [64, 128]
    heads = [(4, 2)] if args.dry_run else [(32, 8), (16, 2)]
    for H, KVH in heads:
        for D in dims:
            for n, S in shapes:
                batch = Paged([S] * n, [0] * n, H, KVH, D, 16, device, dtype, seed=n + D)
                flops = n * 4 * S * S * D * H / 2
                info = dict(case="short", H=H, KVH=KVH, D=D, S=f"{n} x {S}")
                q4, k4, v4 = (x.view(n, S, -1, D).transpose(1, 2)
                              for x in (batch.q, batch.k, batch.v))
                make = lambda b, q4=q4, k4=k4, v4=v4: sdpa_runner(b, q4, k4, v4, is_causal=True)
                ref = None
                for name in BACKENDS:
                    ms, how, out, ms_graph = timed_sdpa(name, make, cuda, graph=cuda)
                    if out is not None and ref is None:
                        ref = out.transpose(1, 2).reshape(n * S, H, D)
                    rows.append(dict(info, kernel=f"sdpa-{name}", ms=ms, tflops=tflops(flops, ms),
                                     ms_graph=ms_graph, tflops_graph=tflops(flops, ms_graph),
                                     how=how))  # fmt: skip
                cfg = INTERPRETER_CONFIG if not cuda else None
                rows.append(ours_row(batch, cfg, "table", flops, ref, cuda, info, graph=cuda))
                for vname, scfg in (SM90_SHORT_VARIANTS.items() if cuda else ()):
                    rows.append(ours_row(batch, scfg, vname, flops, ref, cuda, info, graph=True))


def items_cases(args, cuda, device, dtype, rows):
    """Scoring's item batches: 64 items of 20 or 64 new tokens, each over its own copy of a
    128- to 4,096-token cached query (pages scattered as the pool leaves them). Ours only (SDPA
    has no paged form): the service's pick (query heads packed per KV head) against the tier
    that serves these rows unpacked."""
    n = 3 if args.dry_run else 64
    shapes = [(4, 2, 64)] if args.dry_run else [(9, 3, 64), (32, 8, 64), (32, 8, 128)]
    sizes = [(4, 16)] if args.dry_run else [(20, 128), (20, 1024), (64, 1024), (20, 4096)]
    for H, KVH, D in shapes:
        for new, prefix in sizes:
            batch = Paged([new] * n, [prefix] * n, H, KVH, D, 16, device, dtype, seed=prefix + D)
            flops = n * 4 * D * H * (new * prefix + new * new / 2)
            info = dict(case="items", H=H, KVH=KVH, D=D, S=f"{n} x ({new} new + {prefix} cached)",
                        page_size=16)
            q, k, v, kc, vc, vb = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                                   batch.varlen)
            ref = extend_attention_ref(q.float(), k.float(), v.float(), kc.float(), vc.float(), vb)
            picked = pick_config(D, dtype, q.device, new, prefix, H // KVH)
            names = {"table": INTERPRETER_CONFIG if not cuda else None}
            if cuda and picked.pack_gqa:  # a group of 1 never packs: the tier that serves it
                names["unpacked-tier"] = pick_config(D, dtype, q.device, new, prefix, group=1)
            for vname, cfg in names.items():
                rows.append(ours_row(batch, cfg, vname, flops, ref, cuda, info, graph=cuda))


def extend_cases(args, cuda, device, dtype, rows):
    new, prefix = (16, 48) if args.dry_run else (1024, 8192)
    H, KVH, D = (4, 2, 64) if args.dry_run else (32, 8, 128)
    flops = 4 * D * H * (new * prefix + new * new / 2)
    # a cached prefix: the Hopper kernel does not apply
    names = {k: v for k, v in variants(args.dry_run).items() if not isinstance(v, Sm90Config)}
    for i, page_size in enumerate((16, 1) if args.dry_run else (16, 1, 64)):
        batch = Paged([new], [prefix], H, KVH, D, page_size, device, dtype, seed=page_size)
        info = dict(
            case="extend", H=H, KVH=KVH, D=D, S=f"{new} new + {prefix} cached", page_size=page_size
        )
        slots = batch.slots(0)
        gather = lambda: (batch.k_cache[slots], batch.v_cache[slots])  # noqa: B023
        gather_ms = bench_ms(gather, cuda)
        kc, vc = gather()
        k_all = torch.cat([kc, batch.k]).transpose(0, 1)[None]  # (1, KVH, prefix + new, D)
        v_all = torch.cat([vc, batch.v]).transpose(0, 1)[None]
        q4 = batch.q.transpose(0, 1)[None]  # (1, H, new, D)
        mask = torch.ones((new, prefix + new), dtype=torch.bool, device=device).tril(prefix)
        rep = lambda x: x.repeat_interleave(H // KVH, 1)
        ref = F.scaled_dot_product_attention(q4, rep(k_all), rep(v_all), attn_mask=mask)
        ref = ref[0].transpose(0, 1)  # untimed reference on this page size's data
        if i == 0:  # SDPA does not depend on the page size: time it once
            for name in BACKENDS:
                ms, how, _, _ = timed_sdpa(
                    name, lambda b, q4=q4, k=k_all, v=v_all: _extend_sdpa(b, q4, k, v), cuda
                )
                total = None if ms is None else ms + gather_ms
                rows.append(
                    dict(
                        info,
                        kernel=f"sdpa-{name}",
                        ms=ms,
                        tflops=tflops(flops, ms),
                        how=f"{how}; contiguous K/V, page gather {gather_ms:.3f} ms more",
                        tflops_with_gather=tflops(flops, total),
                    )
                )
        for vname, cfg in names.items():
            rows.append(ours_row(batch, cfg, vname, flops, ref, cuda, info))


def _extend_sdpa(backend, q4, k_all, v_all):
    fn, how = sdpa_runner(
        backend, q4, k_all, v_all, attn_mask=causal_lower_right(q4.shape[2], k_all.shape[2])
    )
    if fn is not None:
        return fn, f"causal_lower_right bias, {how}"
    n_q, n_k = q4.shape[2], k_all.shape[2]
    mask = torch.ones((n_q, n_k), dtype=torch.bool, device=q4.device).tril(n_k - n_q)
    fn, how2 = sdpa_runner(backend, q4, k_all, v_all, attn_mask=mask)
    return fn, (f"explicit bool mask, {how2}" if fn is not None else how)


def window_cases(args, cuda, device, dtype, rows):
    """Gemma 3 1B's local layers on one sequence: ours causal (the table config) and windowed,
    SDPA causal where the backend takes head_dim 256. FLOPs count the keys each query needs
    (windowed: min(i + 1, W)), so the windowed TFLOP/s are effective ones."""
    H, KVH, D = 4, 1, 256
    W = 16 if args.dry_run else 512  # dry: a window shorter than the sequence
    seqs = [64] if args.dry_run else [1024, 2048, 4096, 8192, 16384]
    cfg = INTERPRETER_CONFIG if not cuda else None
    for S in seqs:
        batch = Paged([S], [0], H, KVH, D, 16, device, dtype, seed=S + D)
        info = dict(case="window", H=H, KVH=KVH, D=D, S=S)
        causal, windowed = (4 * D * H * _keys_seen(S, w) for w in (S, W))
        q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (batch.q, batch.k, batch.v))
        make = lambda b, q4=q4, k4=k4, v4=v4: sdpa_runner(b, q4, k4, v4, is_causal=True)
        ref = None
        for name in BACKENDS:
            ms, how, out, _ = timed_sdpa(name, make, cuda)
            if out is not None and ref is None:
                ref = out[0].transpose(0, 1)
            rows.append(dict(info, kernel=f"sdpa-{name}-causal", ms=ms,
                             tflops=tflops(causal, ms), how=how))
        rows.append(ours_row(batch, cfg, "table-causal", causal, ref, cuda, info))
        base = rows[-1].get("ms")
        args32 = (x.float() for x in (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache))
        ref = extend_attention_ref(*args32, batch.varlen, window=W)
        row = ours_row(batch, cfg, f"table-window{W}", windowed, ref, cuda, info, window=W)
        if row.get("ms") and base:
            row["time_vs_causal"] = row["ms"] / base
            row["how"] = (f"{row['time_vs_causal']:.2f}x ours-table-causal's time; relerr vs "
                          "extend_attention_ref with the window")
        rows.append(row)


def _keys_seen(S: int, window: int) -> int:
    """Keys summed over the queries of one sequence: query i sees min(i + 1, window)."""
    w = min(S, window)
    return w * (w + 1) // 2 + (S - w) * w


def launch_overhead(cuda, device, dtype) -> dict:
    """Host microseconds per call on a tiny batch: the launcher (repeating its inputs, so its
    bound launch is reused), checking and binding anew each call, and through the custom op."""
    if not cuda:
        return {}
    import time

    batch = Paged([64, 7], [16, 0], 8, 2, 128, 16, device, dtype)
    meta = (batch.cu, batch.prefix, batch.page_table, 16, 64)
    args = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, VarlenBatch(*meta))
    op_args = (*args[:5], *meta)
    result = {}
    for name, fn in (
        ("launcher", lambda: extend_attention(*args, out=batch.out)),
        # the full check-and-bind path, no reuse (the compiled kernel is still found at once)
        ("launcher, bind each call", lambda: prepare_extend_attention(*args, out=batch.out)[0](
            batch.k_cache, batch.v_cache)),
        ("ops.extend_attention", lambda: ops.extend_attention(*args, out=batch.out)),
        (
            "torch.ops.prefill",
            lambda: torch.ops.prefill.extend_attention(*op_args, 0.1, batch.out),
        ),
    ):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - t0) / 200 * 1e6
    return result


def plot(rows, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    causal = [r for r in rows if r["case"] == "causal" and r.get("tflops")]
    heads = sorted({(r["H"], r["KVH"]) for r in causal}, reverse=True)
    if not heads:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(heads), figsize=(6.5 * len(heads), 4.5), squeeze=False)
    for ax, (H, KVH) in zip(axes[0], heads):
        for D, style in ((64, "--"), (128, "-")):
            for kernel in ("ours-table", "sdpa-cudnn", "sdpa-flash"):
                pts = sorted(
                    (r["S"], r["tflops"])
                    for r in causal
                    if (r["H"], r["KVH"], r["D"], r["kernel"]) == (H, KVH, D, kernel)
                )
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{kernel} D={D}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (causal, one sequence)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{H} q heads / {KVH} kv heads, bf16")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny cases, CPU interpreter")
    parser.add_argument("--small", action="store_true",
                        help="only the causal cases at S = 512 and 1k (a quick re-check)")
    parser.add_argument("--cases", default="causal,short,varlen,extend,items,window",
                        help="comma-separated subset of causal,short,varlen,extend,items,window")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the cases this many times in one process (each row gets "
                             "'rep' and its kernel name a ' (rep N)' suffix)")
    args = parser.parse_args()
    steps = {"causal": causal_cases, "short": short_cases, "varlen": varlen_case,
             "extend": extend_cases, "items": items_cases, "window": window_cases}
    picked = [steps[c] for c in args.cases.split(",")]
    if args.small:
        picked = [causal_cases]
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda" if cuda else "cpu"), torch.bfloat16
    if not cuda and not args.dry_run:
        sys.exit("needs a CUDA GPU (or --dry-run)")
    directory = (
        Path(tempfile.mkdtemp()) if args.dry_run and not os.environ.get("OUT") else out_dir()
    )
    meta = run_meta()
    if cuda:
        meta["table_config_d128"] = str(pick_config(128, dtype, torch.device("cuda")))
        meta["table_config_d64"] = str(pick_config(64, dtype, torch.device("cuda")))
    rows = Rows()
    for rep in range(args.repeats):
        first = len(rows)
        for step in picked:
            try:
                step(args, cuda, device, dtype, rows)
            except Exception:  # keep what was measured; the traceback goes into the results
                rows.append(dict(case=step.__name__, kernel="-",
                                 how=traceback.format_exc()[-400:]))
                traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
        if args.repeats > 1:
            for r in rows[first:]:
                r["rep"], r["kernel"] = rep, f"{r['kernel']} (rep {rep})"
    meta["launch_overhead_us"] = launch_overhead(cuda, device, dtype)
    header = [
        "case",
        "H/KVH",
        "D",
        "S",
        "page",
        "kernel",
        "ms",
        "TFLOP/s",
        "TFLOP/s graph",
        "TFLOP/s +gather",
        "relerr vs SDPA",
        "how",
    ]
    table = [
        [
            r["case"],
            f"{r.get('H')}/{r.get('KVH')}",
            r.get("D"),
            r.get("S"),
            r.get("page_size"),
            r["kernel"],
            r.get("ms"),
            r.get("tflops"),
            r.get("tflops_graph"),
            r.get("tflops_with_gather"),
            r.get("relerr_vs_sdpa"),
            r.get("how"),
        ]
        for r in rows
    ]
    note = plot(rows, directory / "attention.png")
    md = (
        "FLOPs: causal 4·S²·D·H/2; varlen: the sum over sequences; extend "
        "4·D·H·(new·prefix + new²/2); window 4·D·H·Σᵢ min(i + 1, W), its causal rows W = S. "
        "Times are medians of triton.testing.do_bench (L2 flushed before each run).\n\n"
        + markdown_table(header, table)
        + f"\n\nlauncher overhead (host µs/call): {meta['launch_overhead_us']}\n"
    )
    json_path, md_path = write_results(directory, "attention", meta, {"rows": rows}, md)
    print(f"{note}\nwrote {json_path} and {md_path}\n")
    print(md)


if __name__ == "__main__":
    main()
