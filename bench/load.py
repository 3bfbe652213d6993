"""Closed-loop load test of POST /v1/prefill: requests/s, prompt tokens/s and TTFT per concurrency.

Each concurrency level runs C clients that send one request after another, each request
--prompts-per-request prompts of random token ids (nothing is shared between prompts), until
--duration seconds or --max-requests requests, whichever comes first. TTFT is the client-side
latency of one request (it returns each prompt's first token); prompt tokens/s counts every prompt.
Before the server starts (one device, never both at once), a subprocess with the server's
environment builds the engine in-process and times one forward of each level's prompts in flight
(C × N, as many as one forward holds): the `HTTP / engine` column is the share of the engine's
throughput the service delivers over HTTP (--no-engine skips it; --url has no engine figure).
The C clients are spread over client processes, one per CLIENTS_PER_PROCESS clients within the
CPUs the server leaves, each a minimal HTTP/1.1 keep-alive client on one event loop (httpx costs
too much per request to load a fast server).
Each level reports the busiest client process's CPU share (a warning above CLIENT_CPU_LIMIT) and
the server's prompts per forward (from /metrics). Loopback only.
Writes load-<preset>[-x<prompts per request>]-<device>-<date>.{json,md,png} to --out (default
$OUT, else bench/results).

  python bench/load.py --spawn                       # start `python -m service` itself
  python bench/load.py --url http://127.0.0.1:8000   # a running server
  python bench/load.py --spawn --env DEVICE=cuda --env MODEL_PRESET=smollm2-135m \\
      --concurrency 1,16,64,128,256 --prompt-tokens 1024 --prompts-per-request 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing as mp
import os
import re
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
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# NOTE: bench.common (torch) and service are imported where used: every client process imports
# this module, and stays light without them.

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
CLIENTS_PER_PROCESS = 16  # closed-loop clients one client process drives by default
CLIENT_CPU_LIMIT = 0.7  # above this a client process, not the server, may set a level's pace


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def service_env(overrides: dict[str, str]) -> dict[str, str]:
    """The spawned server's environment, which the engine-only run shares."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **overrides, "PYTHONPATH": path}


def spawn(env: dict[str, str], ready_timeout: float, log_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = log_dir / "load-server.log"  # the server's own log, to see why it stopped
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO,
                            env={**env, "HOST": "127.0.0.1", "PORT": str(port)},
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the service exited with {proc.returncode} before /ready (see {log_path})")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the service was not ready after {ready_timeout}s")


def engine_prompts(wanted: int, prompt_tokens: int, max_batch_prompts: int,
                   max_prefill_tokens: int, free_pages: int, page_size: int) -> int:
    """Prompts in one forward: `wanted`, as far as the prompt cap, the token budget and the KV
    pool allow (one prompt, prefilled in chunks, when a prompt exceeds the budget)."""
    fit = min(max_batch_prompts, max_prefill_tokens // prompt_tokens,
              free_pages // -(-prompt_tokens // page_size))
    return max(1, min(wanted, fit))


def time_engine(wanted: list[int], prompt_tokens: int, seconds: float = 1.0) -> list[dict]:
    """Per wanted prompt count: the median time of one forward of that many fresh random
    prompts (capped by engine_prompts) on an engine built from the environment, as the server
    builds it. Runs in its own process, before the server starts."""
    import torch

    from service.config import load_settings, resolve
    from service.engine.batch import SeqChunk
    from service.engine.core import EngineCore

    cfg, _ = resolve(load_settings(), torch.cuda.is_available())
    engine = EngineCore(cfg)
    cuda = engine.device.type == "cuda"
    alloc, page = engine.pool.allocator, engine.pool.page_size
    rng = np.random.default_rng(0)
    vocab = engine.model_cfg.vocab_size
    chunked = prompt_tokens > cfg.max_prefill_tokens
    by_n: dict[int, dict] = {}
    for n in sorted({engine_prompts(w, prompt_tokens, cfg.max_batch_prompts,
                                    cfg.max_prefill_tokens, alloc.num_free, page)
                     for w in wanted}):
        pages = [] if chunked else [alloc.alloc(-(-prompt_tokens // page)) for _ in range(n)]

        def forward(ids: np.ndarray, pages: list = pages) -> None:
            if chunked:
                engine.prefill_chunked(ids[0].tolist())
            else:
                engine.forward([SeqChunk(x, 0, p) for x, p in zip(ids, pages)])

        times: list[float] = []
        t_start = time.perf_counter()
        for i in range(1000):  # the first 2 are warm-up; then at least 3 and `seconds` of them
            ids = rng.integers(100, vocab, (n, prompt_tokens))  # fresh: no cache can help
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward(ids)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            if len(times) >= 3 and time.perf_counter() - t_start >= seconds + 2 * times[0]:
                break
        for p in pages:
            alloc.free(p)
        med = statistics.median(times)
        by_n[n] = {"prompts": n, "forward_s": med, "forwards": len(times),
                   "tokens_per_s": n * prompt_tokens / med}
    engine.close()
    return [by_n[engine_prompts(w, prompt_tokens, cfg.max_batch_prompts, cfg.max_prefill_tokens,
                                alloc.num_free, page)] for w in wanted]


def engine_figures(env: dict[str, str], wanted: list[int], prompt_tokens: int,
                   log_dir: Path, timeout: float) -> list[dict]:
    """time_engine in a subprocess with the server's environment; its log in load-engine.log."""
    code = ("import json, logging; from bench.load import time_engine; "
            "logging.basicConfig(level='INFO'); "
            f"print(json.dumps(time_engine({wanted!r}, {prompt_tokens})))")
    log_path = log_dir / "load-engine.log"
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=timeout,
                             stdout=subprocess.PIPE, stderr=log, text=True)
    if res.returncode != 0:
        sys.exit(f"the engine-only run exited with {res.returncode} (see {log_path})")
    print(f"engine-only run: {time.perf_counter() - t0:.0f}s", flush=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Part:
    """One client process's share of a level."""

    url: str
    headers: dict
    timeout: float
    conc: int
    max_requests: int
    prompt_tokens: int
    prompts: int  # per request
    vocab: int
    start_at: float  # time.time() at which every process starts sending
    duration: float
    seed: int


def run_part(part: Part) -> dict:
    """A client process: part.conc closed-loop workers, one keep-alive connection each."""
    try:
        import uvloop  # noqa: PLC0415 - a faster loop where installed

        return uvloop.run(_part(part))
    except ImportError:
        return asyncio.run(_part(part))


class Connection:
    """A minimal HTTP/1.1 keep-alive client for one POST after another: a few microseconds per
    request where httpx spends hundreds, so the client processes do not set the pace."""

    def __init__(self, url: str, headers: dict, timeout: float, path: str = "/v1/prefill"):
        u = urlparse(url)
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\n"
                     f"Content-Type: application/json\r\n{extra}Content-Length: ")
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"{self.head}{len(body)}\r\n\r\n".encode() + body)
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), self.timeout)
        status = int(head[9:12])
        lower = head.lower()
        i = lower.index(b"content-length:") + 15
        length = int(lower[i:lower.index(b"\r\n", i)])
        data = await asyncio.wait_for(self.reader.readexactly(length), self.timeout)
        if b"connection: close" in lower:
            self.close()
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _part(p: Part) -> dict:
    rng = np.random.default_rng(p.seed)
    lat: list[float] = []
    server_prefill: list[float] = []
    codes: dict[str, int] = {}
    tokens = prompts = sent = 0
    conns = [Connection(p.url, p.headers, p.timeout) for _ in range(p.conc)]
    await asyncio.sleep(max(0.0, p.start_at - time.time()))
    stop_at = time.perf_counter() + p.duration

    async def worker(conn: Connection) -> None:
        nonlocal tokens, prompts, sent
        while time.perf_counter() < stop_at and sent < p.max_requests:
            sent += 1
            ids = rng.integers(100, p.vocab, (p.prompts, p.prompt_tokens)).tolist()
            body = json.dumps({"input_ids": ids if p.prompts > 1 else ids[0]}).encode()
            t0 = time.perf_counter()
            try:
                status, data = await conn.post(body)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
                conn.close()
                continue
            if status != 200:
                codes[str(status)] = codes.get(str(status), 0) + 1
                continue
            lat.append(time.perf_counter() - t0)
            for res in json.loads(data)["results"]:
                prompts += 1
                tokens += res["prompt_tokens"]
                server_prefill.append(res["prefill_ms"] / 1e3)

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(c) for c in conns))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in conns:
        c.close()
    return dict(lat=lat, server_prefill=server_prefill, tokens=tokens, prompts=prompts,
                codes=codes, wall=wall, cpu=cpu)


def _idle(seconds: float) -> None:
    """A task that keeps one pool process busy: mapped once per client before the first level,
    so every client process is started (and has imported this module) before any level."""
    time.sleep(seconds)


def split(total: int, parts: int) -> list[int]:
    """total as `parts` near-equal positive shares (fewer parts if total is smaller)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def client_processes(conc: int, fixed: int | None, cpus: int, server_cpus: int) -> int:
    """`fixed` (--clients), else one process per CLIENTS_PER_PROCESS clients within the CPUs
    the server leaves."""
    if fixed:
        return min(fixed, conc)
    return max(1, min(math.ceil(conc / CLIENTS_PER_PROCESS), cpus - server_cpus))


def level(pool: ProcessPoolExecutor, url: str, conc: int, processes: int,
          args: argparse.Namespace, vocab: int) -> dict:
    """One concurrency level: conc workers over `processes` client processes, started together."""
    before = forward_stats(url, args.headers)
    cpu_before = server_cpu(args.server_log)
    shares = split(conc, processes)
    budgets = split(args.max_requests, len(shares))
    start_at = time.time() + 0.5  # every process has its client open by then
    parts = [Part(url, args.headers, args.timeout, c, m, args.prompt_tokens,
                  args.prompts_per_request, vocab, start_at, args.duration, conc * 1000 + i)
             for i, (c, m) in enumerate(zip(shares, budgets))]
    outs = list(pool.map(run_part, parts))
    after = forward_stats(url, args.headers)
    wall = max(o["wall"] for o in outs)
    cpu = {k: (v - cpu_before.get(k, 0.0)) / wall for k, v in server_cpu(args.server_log).items()}
    workers = [v for k, v in cpu.items() if k.startswith("API worker")]
    threads = [v for k, v in cpu.items() if k.startswith("engine-thread-")]
    lat = [x for o in outs for x in o["lat"]]
    server_prefill = [x for o in outs for x in o["server_prefill"]]
    codes: dict[str, int] = {}
    for o in outs:
        for k, v in o["codes"].items():
            codes[k] = codes.get(k, 0) + v
    forwards = after[1] - before[1]
    return {"concurrency": conc, "clients": len(shares), "requests": len(lat),
            "prompts": sum(o["prompts"] for o in outs), "errors": sum(codes.values()),
            "error_codes": codes, "seconds": wall,
            "prompt_tokens_per_s": sum(o["tokens"] for o in outs) / wall,
            "requests_per_s": len(lat) / wall,
            "ttft_p50_s": pct(lat, 50), "ttft_p99_s": pct(lat, 99),
            "server_prefill_p50_s": pct(server_prefill, 50),
            # above CLIENT_CPU_LIMIT: the client processes may limit the level (add --clients)
            "client_cpu_fraction": max(o["cpu"] / o["wall"] for o in outs),
            "prompts_per_forward": (after[0] - before[0]) / forwards if forwards else None,
            # CPU seconds per second of the level (1.0 = one core busy all the time)
            "engine_cpu": cpu.get("engine"),
            "engine_thread_cpu_max": max(threads) if threads else None,
            "worker_cpu_max": max(workers) if workers else None,
            "worker_cpu_mean": statistics.fmean(workers) if workers else None}


def server_cpu(log: Path | None) -> dict[str, float]:
    """CPU seconds so far of the spawned server's engine and API workers (pids from its log)."""
    if log is None or not log.exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in re.findall(r"started (the engine|API worker \d+) \(pid (\d+)\)",
                                log.read_text()):
        key = "engine" if name == "the engine" else name
        for task in Path(f"/proc/{pid}/task").glob("*"):  # per thread, summed
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            t = (int(fields[11]) + int(fields[12])) / tick
            out[key] = out.get(key, 0.0) + t
            if key == "engine":
                out[f"engine-thread-{task.name}"] = t
    return out


def forward_stats(url: str, headers: dict) -> tuple[float, float]:
    """(prompts, forwards) so far, from the server's prefill_batch_requests histogram."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    got = {}
    for line in text.splitlines():
        for key in ("prefill_batch_requests_sum", "prefill_batch_requests_count"):
            if line.startswith((key + " ", key + "{")):  # with or without labels
                got[key] = float(line.rsplit(" ", 1)[1])
    return got.get("prefill_batch_requests_sum", 0.0), got.get("prefill_batch_requests_count", 0.0)


def sweep(url: str, args: argparse.Namespace, processes: list[int]) -> tuple[dict, list[dict]]:
    info = httpx.get(url + "/info", headers=args.headers, timeout=30).json()
    vocab = info.get("vocab_size") or 32000
    warm = [[100] * args.prompt_tokens] * args.prompts_per_request
    for _ in range(3):  # warm-up, not measured
        httpx.post(url + "/v1/prefill", json={"input_ids": warm}, headers=args.headers,
                   timeout=args.timeout)
    rows = []
    # NOTE: spawn, not fork: a forked child would inherit this process's httpx state
    with ProcessPoolExecutor(max(processes), mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_idle, [0.5] * max(processes)))
        for conc, n in zip(args.concurrency, processes):
            row = level(pool, url, conc, n, args, vocab)
            print(f"c={conc:3d} {row['requests_per_s']:8.1f} req/s "
                  f"{row['prompt_tokens_per_s']:10.0f} tok/s  "
                  f"p50 {row['ttft_p50_s'] or 0:.3f}s  p99 {row['ttft_p99_s'] or 0:.3f}s  "
                  f"({row['requests']} ok, {row['errors']} errors {row['error_codes'] or ''}, "
                  f"{row['prompts_per_forward'] or 0:.1f} prompts/forward, "
                  f"{row['clients']} clients at most {row['client_cpu_fraction']:.0%} CPU; "
                  f"engine {row['engine_cpu'] or 0:.0%} (busiest thread "
                  f"{row['engine_thread_cpu_max'] or 0:.0%}), busiest worker "
                  f"{row['worker_cpu_max'] or 0:.0%} CPU)",
                  flush=True)
            rows.append(row)
    return info, rows


def plot(path: Path, rows: list[dict], title: str) -> Path | None:
    from bench.common import pyplot

    plt = pyplot()
    if plt is None:
        return None
    xs = [r["concurrency"] for r in rows]
    fig, (lat, tput) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        lat.plot(xs, [(r[key] or 0) * 1e3 for r in rows], marker="o", label=f"TTFT {label}")
    lat.set_ylabel("ms")
    tput.plot(xs, [r["prompt_tokens_per_s"] for r in rows], marker="o", label="HTTP")
    if any(r.get("engine_tokens_per_s") for r in rows):
        tput.plot(xs, [r.get("engine_tokens_per_s") or 0 for r in rows], marker="s",
                  linestyle="--", label="engine only")
    tput.set_ylabel("prompt tokens/s")
    for ax in (lat, tput):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (loopback only)")
    where.add_argument("--spawn", action="store_true", help="start `python -m service` here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for --spawn and the engine-only run (the current "
                        "environment passes through), e.g. API_WORKERS=4")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64",
                   help="comma-separated levels, e.g. 1,16,64,128,256")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level (max 600)")
    p.add_argument("--max-requests", type=int, default=500, help="per level (max 100000)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--prompts-per-request", type=int, default=1,
                   help="prompts in each request's input_ids")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=os.environ.get("API_KEY"))
    p.add_argument("--clients", type=int, default=None,
                   help=f"client processes per level (default: one per {CLIENTS_PER_PROCESS} "
                        "clients, at most the CPUs the server leaves)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-only figures")
    p.add_argument("--out", type=Path, help="results directory (default $OUT, else bench/results)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not 0 < args.duration <= 600 or not 0 < args.max_requests <= 100_000:
        p.error("--duration must be in (0, 600] and --max-requests in (0, 100000]")
    if min(args.concurrency) < 1 or args.prompt_tokens < 1 or args.prompts_per_request < 1:
        p.error("--concurrency, --prompt-tokens and --prompts-per-request must be >= 1")
    if args.clients is not None and args.clients < 1:
        p.error("--clients must be >= 1")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))})")
    if any("=" not in kv for kv in args.env):
        p.error("--env takes KEY=VALUE")
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def report(args: argparse.Namespace, rows: list[dict], engine: list[dict] | None) -> str:
    """The markdown table, a line on the engine-only figures and the client CPU warning."""
    from bench.common import markdown_table

    table = markdown_table(
        ["concurrency", "clients", "requests", "errors", "requests/s", "prompt tok/s",
         "engine tok/s", "HTTP / engine", "engine prompts", "TTFT p50 ms", "TTFT p99 ms",
         "server prefill p50 ms", "prompts / forward", "client CPU", "engine CPU",
         "engine busiest thread CPU",
         "API worker CPU max / mean"],
        [[r["concurrency"], r["clients"], r["requests"], r["errors"], r["requests_per_s"],
          r["prompt_tokens_per_s"], r["engine_tokens_per_s"], r["http_over_engine"],
          r["engine_prompts"], (r["ttft_p50_s"] or 0) * 1e3, (r["ttft_p99_s"] or 0) * 1e3,
          (r["server_prefill_p50_s"] or 0) * 1e3, r["prompts_per_forward"],
          r["client_cpu_fraction"], r.get("engine_cpu"), r.get("engine_thread_cpu_max"),
          f"{r['worker_cpu_max']:.2f} / {r['worker_cpu_mean']:.2f}"
          if r.get("worker_cpu_max") is not None else None] for r in rows])
    lines = [table, ""]
    if engine is not None:
        lines.append("engine tok/s: the median of one forward of the level's prompts in flight "
                     f"(concurrency × {args.prompts_per_request}, as many as one forward holds) "
                     "of fresh random prompts, in a process of its own before the server "
                     "started.")
    busy = [r for r in rows if r["client_cpu_fraction"] > CLIENT_CPU_LIMIT]
    if busy:
        lines.append(f"**Warning:** a client process exceeded {CLIENT_CPU_LIMIT:.0%} CPU at "
                     f"concurrency {', '.join(str(r['concurrency']) for r in busy)} (at most "
                     f"{max(r['client_cpu_fraction'] for r in busy):.0%}): the client may limit "
                     "those levels; raise --clients.")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    from bench.common import out_dir, run_meta, write_results
    from service.host import usable_cpus

    args = parse()
    directory = args.out or out_dir()
    directory.mkdir(parents=True, exist_ok=True)
    env = service_env(dict(kv.split("=", 1) for kv in args.env))
    api_workers = env.get("API_WORKERS")
    if api_workers and api_workers != "0":
        workers = int(api_workers)
    else:
        from service.host import auto_api_workers

        workers = auto_api_workers(usable_cpus())
    server_cpus = workers + 2  # its API workers, and the engine process's two busy threads
    processes = [client_processes(c, args.clients, usable_cpus(), server_cpus)
                 for c in args.concurrency]
    wanted = [c * args.prompts_per_request for c in args.concurrency]
    engine = None
    if args.spawn and not args.no_engine:
        engine = engine_figures(env, wanted, args.prompt_tokens, directory,
                                args.ready_timeout + 600)
    elif not args.no_engine:
        print("no engine-only figures with --url (the running server holds the device)")
    proc = None
    url = args.url
    args.server_log = directory / "load-server.log" if args.spawn else None
    if args.spawn:
        proc, url = spawn(env, args.ready_timeout, directory)
    try:
        info, rows = sweep(url.rstrip("/"), args, processes)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    for i, r in enumerate(rows):
        e = engine[i] if engine else {}
        r.update(engine_prompts=e.get("prompts"), engine_forward_s=e.get("forward_s"),
                 engine_tokens_per_s=e.get("tokens_per_s"),
                 http_over_engine=(r["prompt_tokens_per_s"] / e["tokens_per_s"]
                                   if e else None))
    meta = run_meta()
    meta.update(service_device=info.get("device"), device_name=info.get("device_name"),
                model=info.get("model"), dtype=info.get("dtype"),
                graphs=info.get("graph", {}).get("enabled"), prompt_tokens=args.prompt_tokens,
                prompts_per_request=args.prompts_per_request,
                preset=env.get("MODEL_PRESET"), api_workers=workers,
                engine_only=engine is not None)
    device = (info.get("device_name") or info.get("device") or "unknown").replace(" ", "-")
    device = device.lower().removeprefix("nvidia-")
    shape = env.get("MODEL_PRESET") or info.get("model") or "model"
    batched = f"-x{args.prompts_per_request}" if args.prompts_per_request > 1 else ""
    name = f"load-{shape}{batched}-{device}-{datetime.date.today().isoformat()}"
    md = report(args, rows, engine)
    paths = write_results(directory, name, meta, {"levels": rows}, md)
    png = plot(directory / f"{name}.png", rows,
               f"{meta['model']} {args.prompts_per_request} × {args.prompt_tokens}-token "
               f"prompts per request on {device}")
    print(md)
    print("wrote", *paths, png or "(no matplotlib: no PNG)")
    best = statistics.fmean(r["prompt_tokens_per_s"] for r in rows) if rows else 0
    print(f"mean prompt tok/s over levels: {best:.0f}")


if __name__ == "__main__":
    main()
