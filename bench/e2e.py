"""End-to-end prefill on one GPU: tokens/s, latency and MFU, ours vs Hugging Face transformers.

One run, random weights of real shapes (bf16), same weights for every path:
  ours-graph   CUDA graphs + Triton kernels (the service's path: full graphs up to 1,024
               tokens and 8 prompts, breakable graphs above)
  ours-breakable  the same with breakable graphs only (CUDA_GRAPH_FULL_MAX_TOKENS=0)
  ours-graph-unfolded  ours-graph with FOLD_NORMS=false (the norm kernels kept; run on a copy
               of the weights taken before any variant folds them)
  ours-graph-fp8  ours-graph with QUANTIZATION=fp8 (per-channel e4m3 weights, per-token
               activations; on a copy of the weights taken before any variant folds them)
  ours-eager   Triton kernels, no graphs
  ours-refattn no graphs, PyTorch reference attention (per-sequence SDPA) + Triton dense kernels
  hf-sdpa      transformers (sdpa attention), LM head on the last token only
Batches of 8,192 tokens from prompts of 128 / 1k / 8k tokens; single 128- and 1k-token prompts.
MFU = (2 × non-embedding params × tokens + causal attention FLOPs) / time / measured bf16 GEMM
ceiling. Also a torch-profiler summary of the top kernels for two cases.

Usage: python bench/e2e.py [--models smollm2-135m,llama-3.2-1b] [--skip-hf] [--profile]
Writes e2e.json / e2e.md / e2e_tokens.png / e2e_mfu.png to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, pyplot, run_meta, write_results  # noqa: E402
from service.config import EngineConfig  # noqa: E402
from service.engine.batch import SeqChunk  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.attention import AttentionBackend  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.families import hf_dict, preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402
from service.model.weights import load_hf_state  # noqa: E402

MODELS = ["smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b"]
CASES = [(64, 128), (8, 1024), (1, 8192), (1, 128), (1, 1024)]  # (prompts, tokens each)


def layer_params(c: ModelConfig) -> int:
    h, f = c.hidden_size, c.intermediate_size
    return c.num_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * f)


def attended_keys(s: int, window: int = 0) -> int:
    """Keys summed over the queries of one causal prompt of s tokens (windowed: at most W)."""
    if not window or s <= window:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * window


def flops(c: ModelConfig, bs: int, s: int) -> float:
    keys = sum(attended_keys(s, c.window(i)) for i in range(c.num_layers))
    return 2 * layer_params(c) * bs * s + bs * 4 * keys * c.head_dim * c.num_heads


def gemm_ceiling() -> float:
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192**3 / ms / 1e9  # TFLOP/s


def timed(fn, reps: int, warmup: int = 3, warmup_s: float = 0.2) -> float:
    """Median wall milliseconds of fn() (fn synchronizes: it returns logits on the host), after
    at least `warmup` calls and `warmup_s` seconds of them (a steady state: a few calls of a
    sub-millisecond forward leave the GPU and host clocks where the previous case left them)."""
    t0, i = time.perf_counter(), 0
    while i < warmup or time.perf_counter() - t0 < warmup_s:
        fn()
        i += 1
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed_ahead(engine: EngineCore, chunks: list[SeqChunk], forwards: int) -> float:
    """Milliseconds per forward when each is launched before the previous one is waited for, as
    the engine loop runs them under load: one forward's host work hides under the GPU work of
    the one before (the median of three runs of `forwards` forwards)."""
    for _ in range(3):
        engine.forward(chunks)
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0, prev = time.perf_counter(), None
        for _ in range(forwards):
            cur = engine.launch(chunks)
            if prev is not None:
                prev.wait()
            prev = cur
        prev.wait()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / forwards)
    return statistics.median(runs)


def engine_cfg(graphs: bool, page_size: int = 16, full: bool = True,
               fold: bool = True, quantization: str = "none") -> EngineConfig:
    return EngineConfig(model_path=None, device="cuda", dtype="bfloat16",
                        mem_fraction_static=0.70, max_prefill_tokens=8192,
                        cuda_graph_max_tokens=8192 if graphs else 0, cuda_graph_buckets=None,
                        page_size=page_size, max_prompt_tokens=32768, max_queue_requests=256,
                        max_batch_prompts=256, kv_cache_bytes=1 << 28,
                        cuda_graph_full_max_tokens=1024 if full else 0, fold_norms=fold,
                        quantization=quantization)


def _time_cases(engine: EngineCore, cfg: ModelConfig, gen: torch.Generator,
                profiled: tuple[tuple[int, int], ...] = ()) -> dict:
    """Each case's median ms and mode; cases in `profiled` also get a profile (under "profile")."""
    out = {}
    for bs, s in CASES:
        ids = torch.randint(0, cfg.vocab_size, (bs, s), generator=gen).tolist()
        pages = [engine.pool.allocator.alloc(pages_for(s, 16)) for _ in range(bs)]
        chunks = [SeqChunk(x, 0, p) for x, p in zip(ids, pages)]  # as Requests make them
        ms = timed(lambda: engine.forward(chunks), 30 if bs * s <= 1024 else 10)  # noqa: B023
        full = engine.runs.get("full", 0)
        mode = engine.forward(chunks).mode
        out[f"{bs}x{s}"] = dict(ms=ms, mode="full-graph" if engine.runs.get("full", 0) > full
                                else mode,
                                ahead_ms=timed_ahead(engine, chunks, 30 if bs * s <= 1024 else 10))
        if (bs, s) in profiled:
            out[f"{bs}x{s}"]["profile"] = profile(engine.forward, chunks, f"{cfg.name} {bs}x{s}")
        for p in pages:
            engine.pool.allocator.free(p)
    return out


def run_ours(loaded: LoadedModel, variant: str, gen: torch.Generator,
             profiled: tuple[tuple[int, int], ...] = ()) -> dict:
    cfg, model = loaded.cfg, loaded.model
    model.attn = AttentionBackend("torch" if variant == "ours-refattn" else "triton", cfg)
    unfolded = variant in ("ours-graph-unfolded", "ours-graph-fp8")
    assert not (unfolded and model.norms_folded), f"{variant} needs unfolded weights"
    engine = EngineCore(engine_cfg(graphs=variant.startswith(("ours-graph", "ours-breakable")),
                                   full=variant != "ours-breakable", fold=not unfolded,
                                   quantization="fp8" if variant.endswith("fp8") else "none"),
                        loaded=loaded)
    try:
        out = _time_cases(engine, cfg, gen, profiled)
        out["_memory"] = dataclasses.asdict(engine.memory)
    finally:
        engine.close()
        del engine  # the KV pool goes with it: the next variant sizes its own
        gc.collect()
        torch.cuda.empty_cache()
        model.attn = AttentionBackend("triton", cfg)
    return out


def hf_model(cfg: ModelConfig):
    """transformers' own implementation of `cfg`'s family and shape (SDPA attention), bf16."""
    import transformers

    d = hf_dict(cfg) | {"max_position_embeddings": 16384}
    hcfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(
            hcfg, attn_implementation="sdpa").to(torch.bfloat16).eval()
    return m


def run_hf(m, cfg: ModelConfig, gen: torch.Generator) -> dict:
    out = {}
    for bs, s in CASES:
        ids = torch.randint(0, cfg.vocab_size, (bs, s), generator=gen).cuda()
        mask = torch.ones_like(ids)

        @torch.no_grad()
        def run(ids=ids, mask=mask):
            h = m.model(input_ids=ids, attention_mask=mask).last_hidden_state
            return m.lm_head(h[:, -1]).float().cpu()

        out[f"{bs}x{s}"] = dict(ms=timed(run, 30 if bs * s <= 1024 else 10), mode="hf")
    return out


KERNEL_CLASSES = (("attention", ("attention",)),
                  ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def gap_split(events: list[tuple[float, float, str]]) -> dict[str, dict]:
    """GPU idle time (us in, ms out) between consecutive kernels, by what borders each gap: a
    memset (a graph's memset node drains the pipeline: ~3 us against ~0.4 between kernels), an
    attention launch (outside the breakable graphs), else the rest."""
    out = {k: dict(ms=0.0, count=0) for k in ("memset", "attention", "rest")}
    events = sorted(events)
    for (_, end, a), (start, _, b) in zip(events, events[1:]):
        names = (a.lower(), b.lower())
        kind = ("memset" if any("memset" in n for n in names) else
                "attention" if any(kernel_class(n) == "attention" for n in names) else "rest")
        out[kind]["ms"] += max(start - end, 0.0) / 1e3
        out[kind]["count"] += 1
    return out


def profile(engine_forward, chunks, label: str, top: int = 12) -> dict:
    """One forward under torch.profiler: wall, the GPU's busy span (first kernel's start to the
    last one's end), kernel time by class (gemm / attention / other), the idle time between
    kernels by what borders it (`gap_split`) and the top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    for _ in range(3):
        engine_forward(chunks)
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine_forward(chunks)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels, classes, first, last = {}, {}, float("inf"), 0.0
    events = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ms = ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else 0.0
            k = kernels.setdefault(ev.name, [0.0, 0])
            k[0] += ms
            k[1] += 1
            c = classes.setdefault(kernel_class(ev.name), [0.0, 0])
            c[0] += ms
            c[1] += 1
            first, last = min(first, ev.time_range.start), max(last, ev.time_range.end)
            events.append((ev.time_range.start, ev.time_range.end, ev.name))
    total = sum(v[0] for v in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(label=label, wall_ms=wall, kernel_ms=total,
                span_ms=max(last - first, 0.0) / 1e3, gaps=gap_split(events),
                classes={c: dict(ms=v[0], calls=v[1]) for c, v in classes.items()},
                launches=sum(v[1] for v in kernels.values()),
                top=[dict(name=n[:90], ms=v[0], calls=v[1], share=v[0] / max(total, 1e-9))
                     for n, v in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default="ours-graph,ours-eager,ours-refattn,hf-sdpa")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    meta = run_meta()
    ceiling = gemm_ceiling()
    meta["gemm_tflops"] = round(ceiling, 1)
    print(f"bf16 GEMM ceiling {ceiling:.0f} TFLOP/s", flush=True)
    variants = args.variants.split(",")
    results: dict = {"rows": [], "profiles": []}
    for name in args.models.split(","):
        cfg = preset(name)
        gen = torch.Generator().manual_seed(0)
        hf = hf_model(cfg) if "hf-sdpa" in variants else None
        model = random_model(cfg, "cuda", torch.bfloat16)
        if hf is not None:
            load_hf_state(model, hf.state_dict(), f"hf:{name}")  # the same weights
        loaded = LoadedModel(model, None, cfg, Path(name), 0.0)
        copies = {v: dataclasses.replace(loaded, model=copy.deepcopy(model))
                  for v in ("ours-graph-unfolded", "ours-graph-fp8") if v in variants}
        per = {}
        for v in variants:  # the copies, taken before any fold; fp8 quantizes its own
            t0 = time.perf_counter()
            if v == "hf-sdpa":
                per[v] = run_hf(hf, cfg, gen)
            else:
                per[v] = run_ours(copies.pop(v, loaded), v, gen)
            print(f"{name} {v}: {per[v]} ({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.profile and name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"):
            engine = EngineCore(engine_cfg(True), loaded=loaded)
            for bs, s in [(1, 128), (8, 1024)]:
                pages = [engine.pool.allocator.alloc(pages_for(s, 16)) for _ in range(bs)]
                ids = torch.randint(0, cfg.vocab_size, (bs, s), generator=gen).tolist()
                chunks = [SeqChunk(x, 0, p) for x, p in zip(ids, pages)]  # as Requests make them
                results["profiles"].append(profile(engine.forward, chunks,
                                                   f"{name} ours-graph {bs}x{s}"))
                for p in pages:
                    engine.pool.allocator.free(p)
            engine.close()
            del engine
        for bs, s in CASES:
            key = f"{bs}x{s}"
            row = dict(model=name, case=key, tokens=bs * s)
            for v in variants:
                ms = per[v][key]["ms"]
                row[v] = dict(ms=ms, tok_s=bs * s / ms * 1e3,
                              mfu=flops(cfg, bs, s) / ms / 1e9 / ceiling,
                              mode=per[v][key]["mode"])
            results["rows"].append(row)
        for v, tag in (("ours-graph", ""), ("ours-graph-fp8", " fp8")):
            if v in per:
                results.setdefault("memory", {})[name + tag] = per[v].get("_memory")
        del hf, model, loaded, copies
        gc.collect()
        torch.cuda.empty_cache()

    header = ["model", "case"] + [f"{v} {m}" for v in variants for m in ("ms", "tok/s", "MFU")]
    header += ["graph vs hf"]
    rows = []
    for r in results["rows"]:
        line = [r["model"], r["case"]]
        for v in variants:
            line += [r[v]["ms"], round(r[v]["tok_s"]), round(r[v]["mfu"], 3)]
        if "hf-sdpa" in variants and "ours-graph" in variants:
            line.append(f"{r['hf-sdpa']['ms'] / r['ours-graph']['ms']:.2f}x")
        rows.append(line)
    md = markdown_table(header, rows)
    for p in results["profiles"]:
        md += (f"\n\n### profile: {p['label']} — wall {p['wall_ms']:.2f} ms, kernels "
               f"{p['kernel_ms']:.2f} ms in {p['launches']} launches "
               f"(wall/kernels {p['wall_ms'] / max(p['kernel_ms'], 1e-9):.2f})\n\n")
        md += markdown_table(["kernel", "ms", "calls", "share"],
                             [[k["name"], k["ms"], k["calls"], f"{k['share']:.0%}"]
                              for k in p["top"]])
    out = out_dir()
    write_results(out, "e2e", meta, results, md)
    if not plot(results, variants, out):
        print("matplotlib missing: no plots")
    print(md)


def plot(results: dict, variants: list[str], out: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    for metric, fname, label in (("tok_s", "e2e_tokens.png", "prompt tokens/s"),
                                 ("mfu", "e2e_mfu.png", "MFU")):
        big = [r for r in results["rows"] if r["tokens"] == 8192]
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / len(variants)
        xs = range(len(big))
        for i, v in enumerate(variants):
            ax.bar([x + i * width for x in xs], [r[v][metric] for r in big], width, label=v)
        ax.set_xticks([x + 0.4 - width / 2 for x in xs])
        ax.set_xticklabels([f"{r['model']}\n{r['case']}" for r in big], fontsize=7)
        ax.set_ylabel(label)
        ax.set_title(f"8,192-token prefill batches, {label}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    return True


if __name__ == "__main__":
    main()
