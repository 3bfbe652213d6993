"""Engine and API-worker memory over a long mixed run: RSS every 1,000 requests.

Starts `python -m service` in --repo on the CPU: the default model, API_WORKERS=2, PORT and
ADMIN_PORT from --port, and CPU_THREADS=1 (on a loaded 2-core host two spinning OpenMP threads
wait on each other at every op: a forward takes ten times as long); --env sets any other
setting or variable (torch's own thread count without the spinning: `--env CPU_THREADS=0 --env
OMP_WAIT_POLICY=PASSIVE`). Sends --requests mixed requests at --concurrency: /v1/prefill (text,
token ids, several prompts, prompt_logprobs / top_logprobs, a shared prefix for prefix-cache
hits), completions, chat, /v1/score, /tokenize, bad inputs (400s) and client timeouts
(cancels); samples VmRSS and RssAnon of the engine, each worker and the admin server (where the
checkout has one) at the start and every --every requests. Each run adds its column (--label) to
--out's JSON and rewrites the markdown and PNG beside it. --trace has every process trace its
allocations from the first sample on and dump a tracemalloc snapshot and its live objects by
type at each sample (bench/trace_hook; slow: for finding what grows, not for the figures).

  git worktree add /tmp/base <commit>
  python bench/engine_memory.py --repo /tmp/base --label before
  python bench/engine_memory.py --repo . --label after
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import markdown_table, run_meta  # noqa: E402
from bench.hardening_service import checkout_service, proc_stat  # noqa: E402

LOOP = "127.0.0.1"
FIELDS = ("VmRSS", "RssAnon")  # RssAnon: the heap; VmRSS adds mapped files (torch's code)
SETTINGS = {"DEVICE": "cpu", "API_WORKERS": "2", "CPU_THREADS": "1"}
OUT = Path(__file__).resolve().parent / "results" / "engine-memory-cpu-2026-12-04"
WORDS = ("the quick brown fox jumps over a lazy dog while seven small robots count green apples "
         "near an old river bridge under cold winter light and every tired engineer writes "
         "short notes about memory pages queues caches kernels tokens prompts").split()
SYSTEM = "You are a careful assistant. " * 3  # chat's shared prefix: prefix-cache hits
PREFIXES = [[(i * 7919 + p * 104729) % 49000 + 10 for i in range(32)] for p in range(24)]
KINDS = {"prefill_text": 18, "prefill_logprobs": 10, "prefill_prefix": 14, "prefill_multi": 6,
         "completions": 12, "chat": 12, "score": 8, "tokenize": 8, "bad": 7, "cancel": 5}
BAD = [("/v1/prefill", {}), ("/v1/prefill", {"input_ids": [5, 10**7]}),
       ("/v1/prefill", {"prompt": "hi", "top_logprobs": 10**6}),
       ("/v1/prefill", {"prompt": "hi", "temperature": "hot"}),
       ("/v1/completions", {"prompt": "hi", "max_tokens": 5, "n": 0}),
       ("/v1/chat/completions", {"messages": []}),
       ("/v1/score", {"query": "hi", "items": ["a"]}), ("/tokenize", {"prompt": 5})]


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def request(i: int) -> tuple[str, str, dict | bytes, float]:
    """Request i of the run: (kind, path, body, client timeout s); the same for every run."""
    rng = random.Random(i)
    kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
    t = text(rng, 1, 10)
    if kind == "prefill_text":
        return kind, "/v1/prefill", {"prompt": t, "top_logprobs": rng.randint(0, 5)}, 60
    if kind == "prefill_logprobs":
        ids = [rng.randint(10, 49000) for _ in range(rng.randint(4, 16))]
        return kind, "/v1/prefill", {"input_ids": ids, "prompt_logprobs": True,
                                     "top_logprobs": rng.randint(0, 3)}, 60
    if kind == "prefill_prefix":
        ids = rng.choice(PREFIXES) + [rng.randint(10, 49000) for _ in range(rng.randint(1, 8))]
        return kind, "/v1/prefill", {"input_ids": ids}, 60
    if kind == "prefill_multi":
        return kind, "/v1/prefill", {"prompts": [text(rng, 2, 10) for _ in range(3)]}, 60
    if kind == "completions":
        return kind, "/v1/completions", {"prompt": t, "max_tokens": 1, "logprobs": 2,
                                         "echo": rng.random() < 0.2}, 60
    if kind == "chat":
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]
        return kind, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                              "logprobs": True, "top_logprobs": 2}, 60
    if kind == "score":
        items = [" " + text(rng, 1, 4) for _ in range(rng.randint(1, 4))]
        labels = [rng.randint(10, 49000) for _ in range(2)]
        return kind, "/v1/score", {"query": t, "items": items, "label_token_ids": labels}, 60
    if kind == "tokenize":
        return kind, "/tokenize", {"prompt": t, "return_token_strs": rng.random() < 0.5}, 60
    if kind == "bad":
        path, body = rng.choice(BAD + [("/v1/prefill", b"{not json")])
        return kind, path, body, 60
    ids = [rng.randint(10, 49000) for _ in range(rng.randint(32, 96))]
    return kind, "/v1/prefill", {"input_ids": ids}, rng.uniform(0.01, 0.1)


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, VmHWM in MB and CPU seconds of process `pid` ({} once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        stat = proc_stat(pid) or []
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines)
          if k in ("VmRSS", "RssAnon", "VmHWM")}
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") if stat else None
    return {**{k: round(v / 1024, 1) for k, v in kb.items()}, "cpu_s": cpu}


class Service:
    """`python -m service` in `repo` on the CPU, its own process group and TMPDIR, ready."""

    def __init__(self, repo: Path, port: int, tmp: Path, trace: Path | None,
                 extra: dict[str, str]):
        self.port, self.tmp = port, tmp
        for p in (port, port + 1):  # else /ready may be another service's answer
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
                sock.bind((LOOP, p))
        path = f"{Path(__file__).resolve().parent / 'trace_hook'}:{repo}" if trace else str(repo)
        env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp), "HOST": LOOP,
               "PORT": str(port), "LOG_LEVEL": "warning", **SETTINGS,
               **({"EM_TRACE_DIR": str(trace)} if trace else {}), **extra}
        if "admin_port" in (repo / "service/config.py").read_text():
            env["ADMIN_PORT"] = str(port + 1)
        self.log_path = tmp / "service.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=repo, env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 300
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"not ready: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://{LOOP}:{self.port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def pids(self) -> dict[str, int]:
        """engine (the supervisor's first child), worker-<n> (on PORT) and admin (ADMIN_PORT)."""
        kids = sorted((p.create_time(), p) for p in psutil.Process(self.proc.pid).children()
                      if b"resource_tracker" not in " ".join(p.cmdline()).encode())
        assert kids, f"the service (pid {self.proc.pid}) has no engine or worker processes"
        names, workers = {"engine": kids[0][1].pid}, 0
        for _, p in kids[1:]:
            ports = {c.laddr.port for c in p.net_connections("tcp") if c.status == "LISTEN"}
            if self.port in ports:
                names[f"worker-{workers}"], workers = p.pid, workers + 1
            else:
                names["admin"] = p.pid
        return names

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(15)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


async def send(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
    kind, path, body, timeout = request(i)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    try:
        r = await client.post(path, timeout=timeout, **kw)
        return kind, str(r.status_code)
    except httpx.TimeoutException:
        return kind, "client timeout"
    except httpx.HTTPError as e:
        return kind, type(e).__name__


async def drive(svc: Service, n: int, every: int, concurrency: int, trace: Path | None) -> dict:
    """n requests through `concurrency` senders; a sample when each multiple of `every` is done."""
    samples, statuses, t0 = [], Counter(), time.monotonic()
    done, next_i = 0, 0

    async def sample(at: int) -> None:
        pids = svc.pids()
        if trace:  # every process dumps its snapshot on SIGUSR2 (bench/trace_hook)
            for pid in pids.values():
                os.kill(pid, signal.SIGUSR2)
            await asyncio.sleep(3.0)
        samples.append({"requests": at, "s": round(time.monotonic() - t0, 1),
                        "load": round(os.getloadavg()[0], 2),
                        "rss": {name: {"pid": pid, **rss_mb(pid)}
                                for name, pid in pids.items()}})
        row = "  ".join(f"{k} {v.get('VmRSS')} ({v.get('cpu_s')} cpu s)"
                        for k, v in samples[-1]["rss"].items())
        print(f"{at:6d} requests {samples[-1]['s']:7.1f} s  RSS MB: {row}", flush=True)

    lock = asyncio.Lock()  # a sample is taken with no new request started meanwhile

    async def sender(client: httpx.AsyncClient) -> None:
        nonlocal done, next_i
        while next_i < n:
            async with lock:
                i, next_i = next_i, next_i + 1
            kind, status = await send(client, i)
            statuses[f"{kind} {status}"] += 1
            done += 1
            if done % every == 0:
                at = done
                async with lock:
                    await sample(at)

    await sample(0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://{LOOP}:{svc.port}", limits=limits) as client:
        await asyncio.gather(*(sender(client) for _ in range(concurrency)))
        text = (await client.get("/metrics")).text
    totals = {name: sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                        if ln.startswith(f"{name}_total"))
              for name in ("prefill_prompt_tokens", "prefill_cached_tokens", "prefill_forwards")}
    return {"samples": samples, "statuses": dict(sorted(statuses.items())), "metrics": totals,
            "wall_s": round(time.monotonic() - t0, 1)}


def series(run: dict, name: str, field: str) -> list[float]:
    return [x["rss"].get(name, {}).get(field, float("nan")) for x in run["samples"]]


def growth_rows(run: dict) -> list[list[str]]:
    """Per process and figure: its start, then its change over each `every` requests (MB)."""
    rows = []
    for name in run["samples"][0]["rss"]:
        for field in FIELDS:
            v = series(run, name, field)
            steps = [f"{b - a:+.1f}" for a, b in zip(v, v[1:])]
            rows.append([f"{name} {field}", f"{v[0]}", *steps, f"{v[-1] - v[0]:+.1f}"])
    return rows


def write(out: Path, runs: dict) -> None:
    Path(f"{out}.json").write_text(json.dumps({"runs": runs}, indent=1))
    parts = [f"# {out.name}\n\n{__doc__.split(chr(10))[0]} Figures: VmRSS and "
             "RssAnon (its anonymous part: the heap) in MB, from /proc/<pid>/status; written by "
             "`bench/engine_memory.py`.\n"]
    for label, run in runs.items():
        m, s = run["meta"], run["samples"]
        load = [x["load"] for x in s]
        head = ["process", "start", *(f"{a['requests']}-{b['requests']}"
                                      for a, b in zip(s, s[1:])), "total"]
        parts.append(f"## {label}\n\n`{m['command']}`: `{m['repo']}` at {m['commit']}, "
                     f"{m['date']}, torch {m['torch']}, python {m['python']}, {m['cpus']} CPUs; "
                     f"{run['requests']} requests at concurrency {run['concurrency']} in "
                     f"{run['wall_s']} s (host load {min(load)}-{max(load)}); settings "
                     f"{json.dumps({**SETTINGS, **run.get('env', {})})}.\n\n"
                     + markdown_table(head, growth_rows(run))
                     + f"\n\nStatuses: {json.dumps(run['statuses'])}\n\n"
                     f"Engine counters at the end: {json.dumps(run.get('metrics'))}\n")
    Path(f"{out}.md").write_text("\n".join(parts))
    plot(out, runs)


def plot(out: Path, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 6.5))
    for (label, run), color in zip(runs.items(), ("C0", "C1", "C2", "C3", "C4")):
        x = [p["requests"] for p in run["samples"]]
        for k, name in enumerate(run["samples"][0]["rss"]):
            for field, style in zip(FIELDS if k == 0 else FIELDS[:1], ("-", "--")):
                v = series(run, name, field)
                axes[min(k, 1)].plot(x, [y - v[0] for y in v], style if k < 2 else ":",
                                     color=color, marker="o", ms=3,
                                     label=f"{label}: {name} {field}")
    for ax, title in zip(axes, ("engine process", "API workers (and admin server)")):
        ax.set(title=title, xlabel="requests answered", ylabel="change since the start (MB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle("VmRSS and RssAnon over a mixed CPU run (bench/engine_memory.py)")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose service runs")
    ap.add_argument("--label", default="after", help="this run's name in the results")
    ap.add_argument("--out", type=Path, default=OUT, help="<path>.json/.md/.png; merged")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1_000)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--port", type=int, default=18400, help="PORT; ADMIN_PORT is the next one")
    ap.add_argument("--trace", type=Path, help="a folder for tracemalloc snapshots (slow)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="an extra setting for the service (repeatable)")
    args = ap.parse_args()
    repo = args.repo.resolve()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                                    text=True).stdout.strip()
    changed = [ln.split()[-1] for ln in git("status", "--porcelain", "--", "service").splitlines()]
    dirty = f" + uncommitted changes to {', '.join(changed[:6])}" if changed else ""
    meta = {**run_meta(), "command": shlex.join(["python", *sys.argv]), "repo": str(repo),
            "commit": git("rev-parse", "--short", "HEAD") + dirty, "cpus": os.cpu_count(),
            "service_package": checkout_service(repo, sys.executable)}
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-memory-") as tmp:
        extra = dict(kv.split("=", 1) for kv in args.env)
        svc = Service(repo, args.port, Path(tmp), args.trace, extra)
        try:
            run = asyncio.run(drive(svc, args.requests, args.every, args.concurrency, args.trace))
        finally:
            svc.stop()
    run.update(meta=meta, requests=args.requests, concurrency=args.concurrency, env=extra)
    print(json.dumps(run["statuses"], indent=1))
    path = Path(f"{args.out}.json")
    runs = json.loads(path.read_text())["runs"] if path.exists() else {}
    runs[args.label] = run
    write(args.out, runs)
    print(f"wrote {args.out}.json, .md, .png")


if __name__ == "__main__":
    main()
