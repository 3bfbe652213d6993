"""Retrieval over HTTP: /v1/embeddings against /v1/prefill, and /v1/rerank under open-loop load.

Embeddings: per model one server (MODEL_PRESET's random weights, POOLING=last, NORMALIZE=true);
each shape (prompts × tokens a request) runs closed-loop on /v1/prefill, then /v1/embeddings
(base64, the OpenAI SDK's default), fresh random token ids a request (no prefix hits): tok/s each.
Rerank (SGLang PR #9748's workload): SCORE_HEAD=yes-no, each item a 120-token query + 180-token
document as text (single-token words; each answer's usage checked), Poisson arrivals a QPS point,
latency from the scheduled arrival; a sweep stops past --stop-p99 or 5 % errors.
Usage: python bench/retrieval.py [--models qwen3-0.6b,qwen3-8b] [--rerank-model qwen3-0.6b]
       [--sweep 10:50,100 --sweep 1:250,500] [--device cpu] [--env MODEL_PATH=<tokenizer dir>]
Writes retrieval-<device>-<date>.{json,md,png} to --out (default $OUT, else bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.load import server_cpu, service_env, spawn, split  # noqa: E402
from bench.retrieval_clients import TIMEOUT_S, Closed, Open, merged, run, words  # noqa: E402

P99_TARGET_S = 0.5


def with_server_cpu(row: dict, log: Path, before: dict[str, float]) -> dict:
    """The server's engine-process and busiest API worker CPU share over the point."""
    cpu = {k: (v - before.get(k, 0.0)) / row["seconds"] for k, v in server_cpu(log).items()}
    workers = [v for k, v in cpu.items() if k.startswith("API worker")]
    return {**row, "engine_cpu": cpu.get("engine"), "worker_cpu_max": max(workers, default=None)}


def closed_point(pool, url: str, path: str, shape: tuple[int, int], args, vocab: int,
                 log: Path) -> dict:
    n, tokens = shape
    for _ in range(2):  # warm-up: this shape's first forwards
        ids = np.random.default_rng().integers(100, vocab, (n, tokens)).tolist()
        body = ({"input": ids, "encoding_format": "base64"} if path == "/v1/embeddings"
                else {"input_ids": ids})
        r = httpx.post(url + path, json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text[:300]
    start, before = time.time() + 0.5, server_cpu(log)
    seed = (path == "/v1/embeddings") * 10**6 + n * 1000  # other ids: no prefix-cache hits
    parts = [Closed(url, path, c, n, tokens, vocab, start, args.embed_s, seed + i)
             for i, c in enumerate(split(args.concurrency, args.clients))]
    return with_server_cpu(merged(list(pool.map(run, parts))), log, before)


def open_point(pool, url: str, qps: float, docs: int, text: dict, args, log: Path,
               seconds: float) -> dict:
    start, before = time.time() + 1.0, server_cpu(log)
    parts = [Open(url, qps / args.clients, docs, args.query_tokens, args.doc_tokens,
                  text["pieces"], text["item_tokens"], start, seconds, i + int(qps) * 31)
             for i in range(args.clients)]
    return with_server_cpu(merged(list(pool.map(run, parts))), log, before)


def model_env(name: str) -> dict[str, str]:
    """A preset name, or a checkpoint directory (which brings its own tokenizer)."""
    return {"MODEL_PATH": str(Path(name).resolve())} if "/" in name else {"MODEL_PRESET": name}


def started(env: dict[str, str], args, tag: str) -> tuple:
    log_dir = args.out / f"server-{tag}"
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, url = spawn(service_env(env), args.ready_timeout, log_dir)
    return proc, url, log_dir / "load-server.log", httpx.get(url + "/info", timeout=30).json()


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def embed_rows(pool, args, res: dict) -> None:
    for name in args.models.split(","):
        env = {"DEVICE": args.device, "POOLING": "last", "NORMALIZE": "true",
               "MAX_QUEUE_REQUESTS": "16384", **args.env, **model_env(name)}
        proc, url, log, res["info"] = started(env, args, f"embed-{Path(name).name}")
        try:
            for shape in args.shapes:
                row = {"model": Path(name).name, "prompts": shape[0], "tokens": shape[1]}
                for route in ("/v1/prefill", "/v1/embeddings"):
                    row[route] = closed_point(pool, url, route, shape, args,
                                              res["info"]["vocab_size"], log)
                row["ratio"] = row["/v1/embeddings"]["tok_s"] / row["/v1/prefill"]["tok_s"]
                print(name, shape, {k: round(row[k]["tok_s"]) for k in ("/v1/prefill",
                      "/v1/embeddings")}, f"ratio {row['ratio']:.3f}", flush=True)
                res["embeddings"].append(row)
        finally:
            stop(proc)
        save(args, res)


def rerank_text(args, env: dict[str, str]) -> dict:
    """Single-token words of the server's tokenizer, and one item's prompt tokens (checked)."""
    from service.api.retrieval.rerank import QWEN3_PREFIX, QWEN3_SUFFIX, QWEN3_TASK
    from service.model.files import model_tokenizer

    tok = model_tokenizer(env.get("MODEL_PATH"))
    rng = np.random.default_rng(0)
    ids = rng.permutation(tok.vocab_size)[:20000]
    pieces = [s for i in ids.tolist() if (s := tok.decode([i])).startswith(" ")
              and s[1:].isascii() and s[1:].isalpha() and tok.encode(s, add_special=False) == [i]]
    assert pieces, "the tokenizer has no single-token words"
    arr, counts = np.array(pieces[:4000], dtype=object), set()
    for _ in range(20):
        q, d = words(rng, arr, args.query_tokens), words(rng, arr, args.doc_tokens)
        assert [len(tok.encode(t, add_special=False)) for t in (q, d)] == [
            args.query_tokens, args.doc_tokens], "a text does not encode to its token count"
        counts.add(len(tok.encode(f"{QWEN3_PREFIX}<Instruct>: {QWEN3_TASK}\n<Query>: {q}\n"
                                  f"<Document>: {d}{QWEN3_SUFFIX}", add_special=False)))
    return {"pieces": tuple(arr.tolist()), "item_tokens": counts.pop() if len(counts) == 1 else 0}


def rerank_rows(pool, args, res: dict) -> None:
    env = {"DEVICE": args.device, "SCORE_HEAD": "yes-no", "MAX_QUEUE_REQUESTS": "16384",
           **args.env, **model_env(args.rerank_model)}
    text = rerank_text(args, env)
    proc, url, log, info = started(env, args, "rerank")
    res["info"] = res["info"] or info
    try:
        for docs, rates in args.sweeps:
            open_point(pool, url, min(rates), docs, text, args, log, 1.0)  # warm-up
            for qps in rates:
                row = {"docs": docs, "qps": qps, "item_tokens": text["item_tokens"],
                       **open_point(pool, url, qps, docs, text, args, log, args.rerank_s)}
                print(f"rerank {docs} docs {qps} QPS: {row['items_s']:.0f} items/s p50 "
                      f"{row['p50_ms']:.0f} ms p99 {row['p99_ms']:.0f} ms errors "
                      f"{row['errors']} {row['error_codes'] or ''} usage mismatches "
                      f"{row['usage_mismatch']} client CPU {row['client_cpu_max']:.0%}",
                      flush=True)
                res["rerank"].append(row)
                if row["p99_ms"] > args.stop_p99 * 1e3 or row["errors"] > 0.05 * (
                        row["requests"] + row["errors"]):
                    break
            save(args, res)
    finally:
        stop(proc)


def best(rows: list[dict], docs: int) -> dict | None:
    ok = [r for r in rows if r["docs"] == docs and r["p99_ms"] <= P99_TARGET_S * 1e3
          and not r["errors"]]
    return max(ok, key=lambda r: r["items_s"], default=None)


def report(embed: list[dict], rerank: list[dict], args) -> str:
    from bench.common import markdown_table

    out = [] if not embed else [
           "## Embeddings against /v1/prefill (closed loop, token ids in, fresh each request)", "",
           markdown_table(
               ["model", "prompts × tokens", "prefill tok/s", "embeddings tok/s", "ratio",
                "prefill p50 ms", "embeddings p50 ms", "errors", "client CPU max"],
               [[r["model"], f"{r['prompts']} × {r['tokens']}", r["/v1/prefill"]["tok_s"],
                 r["/v1/embeddings"]["tok_s"], f"{r['ratio']:.3f}",
                 r["/v1/prefill"]["p50_ms"], r["/v1/embeddings"]["p50_ms"],
                 r["/v1/prefill"]["errors"] + r["/v1/embeddings"]["errors"],
                 max(r[k]["client_cpu_max"] for k in ("/v1/prefill", "/v1/embeddings"))]
                for r in embed]), "",
           f"{args.concurrency} clients over {args.clients} processes, {args.embed_s} s a point.",
           ""]
    out += [] if not rerank else [
           f"## Rerank ({args.query_tokens}-token query + {args.doc_tokens}-token document an "
           "item, Poisson arrivals)", "",
           markdown_table(
               ["docs", "QPS", "items/s", "P50 ms", "P99 ms", "requests", "errors",
                "usage mismatches", "client CPU max", "engine CPU", "busiest worker CPU"],
               [[r["docs"], r["qps"], r["items_s"], r["p50_ms"], r["p99_ms"], r["requests"],
                 r["errors"], r["usage_mismatch"], r["client_cpu_max"], r["engine_cpu"],
                 r["worker_cpu_max"]] for r in rerank]), ""]
    for docs in sorted({r["docs"] for r in rerank}, reverse=True):
        b = best(rerank, docs)
        out.append(f"- {docs} docs a request: " + (
            f"{b['items_s']:.0f} items/s at {b['qps']} QPS, P99 {b['p99_ms']:.0f} ms" if b
            else f"no rate kept P99 <= {P99_TARGET_S * 1e3:.0f} ms without errors"))
    return "\n".join(out) + "\n"


def plot(path: Path, embed: list[dict], rerank: list[dict]) -> Path | None:
    from bench.common import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, (bars, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = np.arange(len(embed))
    for i, route in enumerate(("/v1/prefill", "/v1/embeddings")):
        bars.bar(xs + i * 0.4, [r[route]["tok_s"] for r in embed], 0.4, label=route)
    bars.set_xticks(xs + 0.2)
    bars.set_xticklabels([f"{r['model']}\n{r['prompts']}×{r['tokens']}" for r in embed],
                         fontsize=7)
    bars.set_ylabel("prompt tokens/s")
    for docs in sorted({r["docs"] for r in rerank}, reverse=True):
        rs = [r for r in rerank if r["docs"] == docs]
        (line,) = lat.plot([r["items_s"] for r in rs], [r["p99_ms"] for r in rs], marker="o",
                           label=f"{docs} docs a request: P99 (P50 dashed)")
        lat.plot([r["items_s"] for r in rs], [r["p50_ms"] for r in rs], "--", marker=".",
                 color=line.get_color())
    lat.axhline(P99_TARGET_S * 1e3, color="grey", linewidth=0.8)
    lat.set_xlabel("achieved items/s")
    lat.set_ylabel("latency ms")
    lat.set_yscale("log")
    for ax in (bars, lat):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="presets or checkpoint dirs")
    p.add_argument("--rerank-model", default="qwen3-0.6b")
    p.add_argument("--shapes", default="8x1024,64x128,512x32", help="prompts x tokens a request")
    p.add_argument("--sweep", action="append", metavar="DOCS:QPS,QPS,...", help=(
        "documents a request and the QPS to sweep (default 10:50,...,300 and 1:250,...,2500)"))
    p.add_argument("--query-tokens", type=int, default=120)
    p.add_argument("--doc-tokens", type=int, default=180)
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop embedding clients")
    p.add_argument("--clients", type=int, default=4, help="client processes")
    p.add_argument("--embed-s", type=float, default=5.0, help="seconds an embedding point")
    p.add_argument("--rerank-s", type=float, default=8.0, help="seconds a rerank point")
    p.add_argument("--stop-p99", type=float, default=2.0, help="a sweep stops past this P99 (s)")
    p.add_argument("--skip", choices=["embed", "rerank"], help="leave one part out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="for every server, e.g. MODEL_PATH=<tokenizer dir> for the presets")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="results directory (default $OUT, else bench/results)")
    args = p.parse_args()
    args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    args.sweeps = [(int(d), [float(q) for q in qs.split(",")]) for d, qs in (
        s.split(":") for s in args.sweep or ["10:50,100,150,200,250,300",
                                              "1:250,500,1000,1500,2000,2500"])]
    args.env = dict(kv.split("=", 1) for kv in args.env)
    if "MODEL_PATH" in args.env:
        args.env["MODEL_PATH"] = str(Path(args.env["MODEL_PATH"]).resolve())
    return args


def save(args, res: dict) -> None:
    """The results so far (after each model and sweep: a run cut short keeps what it measured)."""
    from bench.common import run_meta, write_results

    info = res["info"]
    meta = {**run_meta(), "service_device": info.get("device"), "dtype": info.get("dtype"),
            "device_name": info.get("device_name"), "prefix_cache": info.get("prefix_cache"),
            "graphs": info.get("graph", {}).get("enabled"), "rerank_model": args.rerank_model,
            "env": args.env}
    device = (info.get("device_name") or info.get("device") or "unknown").replace(" ", "-")
    name = f"retrieval-{device.lower().removeprefix('nvidia-')}-{datetime.date.today()}"
    md = report(res["embeddings"], res["rerank"], args)
    paths = write_results(args.out, name, meta, {k: res[k] for k in ("embeddings", "rerank")}, md)
    png = plot(args.out / f"{name}.png", res["embeddings"], res["rerank"])
    print("wrote", *paths, png or "(no matplotlib: no PNG)", flush=True)


def main() -> None:
    from bench.common import out_dir

    args = parse()
    args.out = args.out or out_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"embeddings": [], "rerank": [], "info": {}}
    with ProcessPoolExecutor(args.clients, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.5] * args.clients))  # every client process started
        if args.skip != "embed":
            embed_rows(pool, args, res)
        if args.skip != "rerank":
            rerank_rows(pool, args, res)
    print(report(res["embeddings"], res["rerank"], args))


if __name__ == "__main__":
    main()
