"""Scoring many items over one query (/v1/score's engine path) against one prompt per item.

The engine loop (Scheduler + EngineCore, the service's defaults) on one GPU, random weights of a
real shape. Each request is a fresh random query of Q tokens and N items of L tokens; requests
run one after another, each until all its items are answered:
  shared        one request: the query prefilled once, the items over its KV (2 labels)
  shared-0/16   the same with no label tokens / 16 (the labels' cost)
  per-item      N prompts of Q + L tokens, prefix cache off
  per-item-pc   the same with the prefix cache on (pages published by a finished forward are
                reused by the items admitted after it)
  bound         the unique tokens as plain prompts: the query once and N prompts of L tokens,
                prefix cache off, nothing shared; the engine's time for these tokens
items/s = N / median request time; "of bound" = shared items/s / bound items/s.
The fast modes (shared*, bound) run interleaved, one request of each in turn, so a drift of
clocks or host load moves them together; the per-item modes run after them.
With --http, the same through the service (`python -m service`, spawned per model, token ids
in, its defaults: prefix cache on): one POST /v1/score per query against one POST /v1/prefill
holding the N query + item prompts (the labels as logprob_token_ids), one after another, from
bench/load.py's minimal HTTP client, each JSON body built before its clock starts.

Usage: python bench/score.py [--models smollm2-135m,llama-3.2-1b] [--min-s 0.4]
       [--workloads 1024:64:20,...] [--device cpu]  (a CPU run: a smoke test of the script)
       [--http --env MODEL_PATH=.gpu_assets/smollm2]  (then only the HTTP comparison)
Writes score[-http]-<device>-<date>.{json,md,png} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from service.config import EngineConfig  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.engine.interface import SamplingParams  # noqa: E402
from service.engine.prompt import Prompt, shared_query  # noqa: E402
from service.engine.scheduler import Scheduler  # noqa: E402
from service.model.families import preset  # noqa: E402
from service.model.loader import LoadedModel, random_model  # noqa: E402

MODELS = ["smollm2-135m", "llama-3.2-1b"]
# (query tokens, items, item tokens): the target workload, then one axis varied at a time, then
# small requests (where the query's extra forward may cost more than the tokens it saves)
WORKLOADS = [(1024, 64, 20), (256, 64, 20), (4096, 64, 20), (1024, 8, 20), (1024, 256, 20),
             (1024, 64, 4), (1024, 64, 64), (64, 2, 20), (256, 4, 20)]
MODES = ["shared", "shared-0", "shared-16", "per-item", "per-item-pc", "bound"]


class Kept:
    """The core for one Scheduler after another: their close() leaves it open."""

    def __init__(self, core: EngineCore):
        self.core = core

    def __getattr__(self, name):
        return getattr(self.core, name)

    def close(self) -> None:
        pass


def started(core: EngineCore, prefix_cache: bool) -> Scheduler:
    s = Scheduler(lambda: Kept(core), max_queue=4096, max_batch_prompts=256,
                  prefix_cache=prefix_cache)
    ev = threading.Event()
    s.start(lambda exc: ev.set())
    assert ev.wait(60) and s.state == "ready", s.error
    return s


def request(rng: np.random.Generator, vocab: int, q: int, n: int, length: int):
    return (rng.integers(0, vocab, q, dtype=np.int64),
            [rng.integers(0, vocab, length, dtype=np.int64) for _ in range(n)])


def run_request(s: Scheduler, mode: str, query: np.ndarray, items: list[np.ndarray],
                labels: tuple[int, ...]) -> float:
    """Seconds from submit until every item is answered."""
    n = len(items)
    done, left, errors = threading.Event(), [n], []

    def on_done(res, exc) -> None:
        if exc is not None:
            errors.append(exc)
            done.set()
            return
        left[0] -= 1
        if left[0] == 0:
            done.set()

    def on_query(res, exc) -> None:
        if exc is not None:
            errors.append(exc)
            done.set()

    params = SamplingParams(logprob_token_ids=labels)
    if mode.startswith("shared"):
        full = [np.concatenate([query, it]) for it in items]
        prompts = shared_query(full, len(query), params, [on_done] * n, on_query)
    elif mode == "bound":
        prompts = [Prompt(query, params, on_query)] + [Prompt(it, params, on_done)
                                                       for it in items]
    else:
        prompts = [Prompt(np.concatenate([query, it]), params, on_done) for it in items]
    t0 = time.perf_counter()
    s.submit(prompts)
    assert done.wait(120), f"{mode}: {left[0]} of {n} items unanswered"
    assert not errors, errors[0]
    return time.perf_counter() - t0


def label_ids(mode: str, rng: np.random.Generator, vocab: int) -> tuple[int, ...]:
    n = {"shared-0": 0, "shared-16": 16}.get(mode, 2)
    return tuple(int(x) for x in rng.integers(0, vocab, n))


def measure(scheds: dict[bool, Scheduler], modes: list[str], wl: tuple[int, int, int],
            vocab: int, min_s: float, seed: int) -> dict:
    """Median time per request of each mode; `modes` run interleaved, a request each in turn."""
    q, n, length = wl
    rng = np.random.default_rng(seed)
    labels = {m: label_ids(m, rng, vocab) for m in modes}

    def once(mode: str) -> float:
        return run_request(scheds[mode == "per-item-pc"], mode, *request(rng, vocab, q, n, length),
                           labels[mode])

    for _ in range(2):  # warm-up: every shape's first forward, kernels compiled
        for mode in modes:
            once(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    while len(times[modes[0]]) < 3 or (time.perf_counter() - t0 < min_s
                                       and len(times[modes[0]]) < 50):
        for mode in modes:
            times[mode].append(once(mode))
    out = {}
    for mode, ts in times.items():
        ms = statistics.median(ts) * 1e3
        out[mode] = dict(ms=ms, items_s=n / ms * 1e3, reps=len(ts))
    return out


async def http_request(conns: dict, mode: str, query: list[int], items: list[list[int]],
                       labels: list[int]) -> float:
    """Seconds of one request, its JSON body built before the clock starts."""
    if mode == "http-score":
        body = {"query": query, "items": items, "label_token_ids": labels}
    else:
        body = {"input_ids": [query + it for it in items], "logprob_token_ids": labels}
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    status, reply = await conns[mode].post(data)
    elapsed = time.perf_counter() - t0
    assert status == 200, reply[:300]
    out = json.loads(reply)
    assert len(out["scores"] if mode == "http-score" else out["results"]) == len(items)
    return elapsed


async def http_measure(url: str, mode: str, wl: tuple[int, int, int], vocab: int,
                       min_s: float, seed: int) -> dict:
    from bench.load import Connection

    q, n, length = wl
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, vocab, 2).tolist()

    def one() -> tuple[list[int], list[list[int]]]:
        query, items = request(rng, vocab, q, n, length)
        return query.tolist(), [it.tolist() for it in items]

    path = "/v1/score" if mode == "http-score" else "/v1/prefill"
    conns = {mode: Connection(url, {}, 120.0, path)}  # a minimal client: microseconds a request
    try:
        for _ in range(2):
            await http_request(conns, mode, *one(), labels)
        times, t0 = [], time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - t0 < min_s and len(times) < 50):
            times.append(await http_request(conns, mode, *one(), labels))
    finally:
        conns[mode].close()
    ms = statistics.median(times) * 1e3
    return dict(ms=ms, items_s=n / ms * 1e3, reps=len(times))


def http_rows(args, workloads) -> list[dict]:
    from bench.load import service_env, spawn

    rows = []
    for name in args.models.split(","):
        env = service_env({"DEVICE": args.device, "MODEL_PRESET": name,
                           **dict(e.split("=", 1) for e in args.env)})
        proc, url = spawn(env, 300, out_dir())
        try:
            vocab = preset(name).vocab_size
            for i, wl in enumerate(workloads):
                row = dict(model=name, query=wl[0], items=wl[1], item_tokens=wl[2],
                           unique_tokens=wl[0] + wl[1] * wl[2])
                for mode in ("http-score", "http-prefill"):
                    row[mode] = asyncio.run(http_measure(url, mode, wl, vocab, args.min_s, i))
                    print(name, wl, mode, row[mode], flush=True)
                rows.append(row)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return rows


def result_name(kind: str, meta: dict) -> str:
    device = (meta.get("gpu") or "cpu").lower().replace(" ", "-").removeprefix("nvidia-")
    return f"{kind}-{device}-{datetime.date.today().isoformat()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--min-s", type=float, default=0.4, help="timed seconds per case, at least")
    ap.add_argument("--workloads", default=",".join(":".join(map(str, w)) for w in WORKLOADS),
                    help="query:items:item_tokens, comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--http", action="store_true", help="through the service instead")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the service")
    args = ap.parse_args()
    workloads = [tuple(int(x) for x in w.split(":")) for w in args.workloads.split(",")]
    if args.http:
        meta, rows = run_meta(), http_rows(args, workloads)
        md = markdown_table(
            ["model", "query", "items", "item tok", "/v1/score items/s", "ms",
             "/v1/prefill of the N prompts items/s", "ms", "speed-up"],
            [[r["model"], r["query"], r["items"], r["item_tokens"],
              round(r["http-score"]["items_s"]), r["http-score"]["ms"],
              round(r["http-prefill"]["items_s"]), r["http-prefill"]["ms"],
              f"{r['http-score']['items_s'] / r['http-prefill']['items_s']:.2f}x"]
             for r in rows])
        write_results(out_dir(), result_name("score-http", meta), meta, {"rows": rows}, md)
        print(md)
        return
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    meta = run_meta()
    modes = args.modes.split(",")
    rows = []
    for name in args.models.split(","):
        cfg = preset(name)
        loaded = LoadedModel(random_model(cfg, args.device, dtype), None, cfg, Path(name), 0.0)
        core = EngineCore(EngineConfig(device=args.device, dtype=str(dtype)[6:]), loaded=loaded)
        scheds = {pc: started(core, pc) for pc in (False, True)}
        for i, wl in enumerate(workloads):
            row = dict(model=name, query=wl[0], items=wl[1], item_tokens=wl[2],
                       unique_tokens=wl[0] + wl[1] * wl[2])
            fast = [m for m in modes if not m.startswith("per-item")]
            for group in (fast, [m for m in modes if m not in fast]):
                if group:
                    row.update(measure(scheds, group, wl, cfg.vocab_size, args.min_s, seed=i))
            print(name, wl, {m: round(row[m]["ms"], 2) for m in modes}, flush=True)
            rows.append(row)
        for s in scheds.values():
            s.stop(10.0)
        core.close()
        del core, loaded, scheds
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    results = {"rows": rows, "modes": modes}
    md = report(rows, modes)
    out = out_dir()
    name = result_name("score", meta)
    write_results(out, name, meta, results, md)
    try:
        plot(rows, out / f"{name}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    print(md)


def report(rows: list[dict], modes: list[str]) -> str:
    header = ["model", "query", "items", "item tok"] + [f"{m} items/s" for m in modes]
    header += ["shared ms", "vs per-item", "vs per-item-pc", "of bound", "labels 0/2/16 ms"]
    lines = []
    for r in rows:
        line = [r["model"], r["query"], r["items"], r["item_tokens"]]
        line += [round(r[m]["items_s"]) for m in modes]
        sh = r.get("shared")
        ratio = [f"{sh['items_s'] / r[m]['items_s']:.2f}x" if sh and m in r else ""
                 for m in ("per-item", "per-item-pc")]
        line += [round(sh["ms"], 2) if sh else "", *ratio,
                 f"{sh['items_s'] / r['bound']['items_s']:.0%}" if sh and "bound" in r else ""]
        line.append("/".join(f"{r[m]['ms']:.2f}" for m in ("shared-0", "shared", "shared-16")
                             if m in r))
        lines.append(line)
    return markdown_table(header, lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == m]
        xs = np.arange(len(rs))
        for i, mode in enumerate(("shared", "per-item", "per-item-pc", "bound")):
            if mode in rs[0]:
                ax.bar(xs + i * 0.2, [r[mode]["items_s"] for r in rs], 0.2, label=mode)
        ax.set_xticks(xs + 0.3)
        ax.set_xticklabels([f"{r['query']}q\n{r['items']}x{r['item_tokens']}" for r in rs],
                           fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("items/s")
        ax.set_title(f"{m}: /v1/score's engine path")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
