"""Closed-loop load test of POST /v1/prefill: prompt tokens/s and TTFT p50/p99 per concurrency.

Each concurrency level runs C clients that send one prompt after another (random token ids, so
nothing is shared between prompts) until --duration seconds or --max-requests requests, whichever
comes first. TTFT is the client-side latency of one prefill request (it returns the first token).
The C clients are spread over --clients processes (one httpx event loop saturates its core long
before the service does); each level also reports the busiest client process's CPU share and
the server's prompts per forward (from /metrics). Loopback only.
Writes load-<device>-<date>.{json,md,png} to $OUT (default bench/results).

  python bench/load.py --spawn                       # start `python -m service` itself
  python bench/load.py --url http://127.0.0.1:8000   # a running server
  MODEL_PRESET=smollm2-135m DEVICE=cuda python bench/load.py --spawn --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def spawn(env_overrides: dict[str, str], ready_timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **env_overrides, "HOST": "127.0.0.1", "PORT": str(port),
           "PYTHONPATH": path}
    log_path = out_dir() / "load-server.log"  # the server's own log, to see why it stopped
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env,
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the service exited with {proc.returncode} before /ready")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the service was not ready after {ready_timeout}s")


@dataclass(frozen=True)
class Part:
    """One client process's share of a level."""

    url: str
    headers: dict
    timeout: float
    conc: int
    max_requests: int
    prompt_tokens: int
    vocab: int
    start_at: float  # time.time() at which every process starts sending
    duration: float
    seed: int


def run_part(part: Part) -> dict:
    """A client process: part.conc closed-loop workers on one httpx client."""
    return asyncio.run(_part(part))


async def _part(p: Part) -> dict:
    rng = random.Random(p.seed)
    lat: list[float] = []
    server_prefill: list[float] = []
    tokens = errors = sent = 0
    limits = httpx.Limits(max_connections=p.conc + 4)
    async with httpx.AsyncClient(base_url=p.url, timeout=p.timeout, limits=limits,
                                 headers=p.headers) as client:
        await asyncio.sleep(max(0.0, p.start_at - time.time()))
        stop_at = time.perf_counter() + p.duration

        async def worker() -> None:
            nonlocal tokens, errors, sent
            while time.perf_counter() < stop_at and sent < p.max_requests:
                sent += 1
                ids = [rng.randrange(100, p.vocab) for _ in range(p.prompt_tokens)]
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/prefill", json={"input_ids": ids})
                except httpx.HTTPError:
                    errors += 1
                    continue
                if r.status_code != 200:
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)
                res = r.json()["results"][0]
                tokens += res["prompt_tokens"]
                server_prefill.append(res["prefill_ms"] / 1e3)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(p.conc)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return dict(lat=lat, server_prefill=server_prefill, tokens=tokens, errors=errors,
                wall=wall, cpu=cpu)


def _idle(seconds: float) -> None:
    """A task that keeps one pool process busy: mapped once per client before the first level,
    so every client process is started (and has imported this module) before any level."""
    time.sleep(seconds)


def split(total: int, parts: int) -> list[int]:
    """total as `parts` near-equal positive shares (fewer parts if total is smaller)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def level(pool: ProcessPoolExecutor, url: str, conc: int, args: argparse.Namespace,
          vocab: int) -> dict:
    """One concurrency level: conc workers over args.clients processes, started together."""
    before = forward_stats(url, args.headers)
    shares = split(conc, args.clients)
    budgets = split(args.max_requests, len(shares))
    start_at = time.time() + 0.5  # every process has its client open by then
    parts = [Part(url, args.headers, args.timeout, c, m, args.prompt_tokens, vocab, start_at,
                  args.duration, conc * 1000 + i) for i, (c, m) in enumerate(zip(shares, budgets))]
    outs = list(pool.map(run_part, parts))
    after = forward_stats(url, args.headers)
    wall = max(o["wall"] for o in outs)
    lat = [x for o in outs for x in o["lat"]]
    server_prefill = [x for o in outs for x in o["server_prefill"]]
    forwards = after[1] - before[1]
    return {"concurrency": conc, "clients": len(shares), "requests": len(lat),
            "errors": sum(o["errors"] for o in outs), "seconds": wall,
            "prompt_tokens_per_s": sum(o["tokens"] for o in outs) / wall,
            "requests_per_s": len(lat) / wall,
            "ttft_p50_s": pct(lat, 50), "ttft_p99_s": pct(lat, 99),
            "server_prefill_p50_s": pct(server_prefill, 50),
            # near 1: the client processes, not the server, limit the level (add --clients)
            "client_cpu_fraction": max(o["cpu"] / o["wall"] for o in outs),
            "prompts_per_forward": (after[0] - before[0]) / forwards if forwards else None}


def forward_stats(url: str, headers: dict) -> tuple[float, float]:
    """(prompts, forwards) so far, from the server's prefill_batch_requests histogram."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    got = {}
    for line in text.splitlines():
        for key in ("prefill_batch_requests_sum", "prefill_batch_requests_count"):
            if line.startswith(key + " "):
                got[key] = float(line.split()[1])
    return got.get("prefill_batch_requests_sum", 0.0), got.get("prefill_batch_requests_count", 0.0)


def sweep(url: str, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    info = httpx.get(url + "/info", headers=args.headers, timeout=30).json()
    vocab = info.get("vocab_size") or 32000
    for _ in range(3):  # warm-up, not measured
        httpx.post(url + "/v1/prefill", json={"input_ids": [100] * args.prompt_tokens},
                   headers=args.headers, timeout=args.timeout)
    rows = []
    # NOTE: spawn, not fork: a forked child would inherit this process's httpx state
    with ProcessPoolExecutor(args.clients, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_idle, [0.5] * args.clients))
        for conc in args.concurrency:
            row = level(pool, url, conc, args, vocab)
            print(f"c={conc:3d} {row['prompt_tokens_per_s']:10.0f} tok/s  "
                  f"p50 {row['ttft_p50_s'] or 0:.3f}s  p99 {row['ttft_p99_s'] or 0:.3f}s  "
                  f"({row['requests']} ok, {row['errors']} errors, "
                  f"{row['prompts_per_forward'] or 0:.1f} prompts/forward, "
                  f"{row['clients']} clients at most {row['client_cpu_fraction']:.0%} CPU)",
                  flush=True)
            rows.append(row)
    return info, rows


def plot(path: Path, rows: list[dict], title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        ax.plot(xs, [(r[key] or 0) * 1e3 for r in rows], marker="o", label=f"TTFT {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (loopback only)")
    where.add_argument("--spawn", action="store_true", help="start `python -m service` here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for --spawn (the current environment passes through)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level (max 600)")
    p.add_argument("--max-requests", type=int, default=500, help="per level (max 100000)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=os.environ.get("API_KEY"))
    p.add_argument("--clients", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                   help="client processes a level's workers are spread over (one Python "
                        "httpx client tops out near 500-600 requests/s on the H200's host)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not 0 < args.duration <= 600 or not 0 < args.max_requests <= 100_000:
        p.error("--duration must be in (0, 600] and --max-requests in (0, 100000]")
    if args.clients < 1:
        p.error("--clients must be >= 1")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))})")
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main() -> None:
    args = parse()
    proc = None
    url = args.url
    if args.spawn:
        env = dict(kv.split("=", 1) for kv in args.env)
        proc, url = spawn(env, args.ready_timeout)
    try:
        info, rows = sweep(url.rstrip("/"), args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    meta = run_meta()
    meta.update(service_device=info.get("device"), device_name=info.get("device_name"),
                model=info.get("model"), dtype=info.get("dtype"),
                graphs=info.get("graph", {}).get("enabled"), prompt_tokens=args.prompt_tokens,
                preset=os.environ.get("MODEL_PRESET") or dict(
                    kv.split("=", 1) for kv in args.env).get("MODEL_PRESET"))
    device = (info.get("device_name") or info.get("device") or "unknown").replace(" ", "-")
    name = f"load-{device}-{datetime.date.today().isoformat()}"
    table = markdown_table(
        ["concurrency", "clients", "requests", "errors", "prompt tok/s", "TTFT p50 ms",
         "TTFT p99 ms", "server prefill p50 ms", "prompts / forward", "client CPU"],
        [[r["concurrency"], r["clients"], r["requests"], r["errors"], r["prompt_tokens_per_s"],
          (r["ttft_p50_s"] or 0) * 1e3, (r["ttft_p99_s"] or 0) * 1e3,
          (r["server_prefill_p50_s"] or 0) * 1e3, r["prompts_per_forward"],
          r["client_cpu_fraction"]] for r in rows])
    directory = out_dir()
    paths = write_results(directory, name, meta, {"levels": rows}, table)
    png = plot(directory / f"{name}.png", rows,
               f"{meta['model']} {args.prompt_tokens}-token prompts on {device}")
    print(table)
    print("wrote", *paths, png or "(no matplotlib: no PNG)")
    best = statistics.fmean(r["prompt_tokens_per_s"] for r in rows) if rows else 0
    print(f"mean prompt tok/s over levels: {best:.0f}")


if __name__ == "__main__":
    main()
