"""Five hardening scenarios, on loopback, against a service this script starts: a connection
flood against the probes, a short prompt behind a long one, a burst of malformed engine
messages, forged cancels, and a bad prompt inside a batch.

Starts `python -m service` in --repo (that checkout's own `service` package, on the CPU,
API_WORKERS=2, ADMIN_PORT where the checkout knows it), waits for /ready and runs the scenarios
one after another (each function's docstring says what it does), a fresh service for each entry
of SERVICES. The service gets its own TMPDIR, so its socket directory is found without a guess;
its process group is killed at the end. Each run adds its column (--label) to --out's JSON and
rewrites the markdown beside it: a before/after table per scenario.

  git worktree add /tmp/hardening-before HEAD
  (cd /tmp/hardening-before && /work/main/.venv/bin/python /work/main/bench/hardening.py \
      --repo /tmp/hardening-before --label before --out /work/main/bench/results/<name>)
  python bench/hardening.py --repo . --label after --out bench/results/<name>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import markdown_table, run_meta  # noqa: E402
from bench.hardening_service import (  # noqa: E402
    API_WORKERS,
    LOOP,
    Service,
    alive,
    checkout_service,
    post,
    push,
    submit,
)

LONG_TOKENS = 4000  # short-behind-long
# an unforged round must finish well inside the 40 s client timeout on a 2-CPU host, so that a
# request without an answer is the forgery's doing
CANCEL_REQUESTS, CANCEL_TOKENS = 16, 128
BUSY_TOKENS = 1000  # holds the engine while a batch of bad and legit prompts queues


def ids(seed: int, n: int) -> list[int]:
    """n token ids, distinct per seed (no prefix-cache hits between requests)."""
    return [(i * 7919 + seed * 104729) % 49000 + 10 for i in range(n)]


# -- 1: connection flood ----------------------------------------------------------------------
HELD_HEAD = (b"POST /v1/prefill HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{\"input_ids\": [1, ")


async def get_status(port: int, path: str = "/health", timeout: float = 2.0) -> int | None:
    async def get() -> int:
        r, w = await asyncio.open_connection(LOOP, port)
        try:
            w.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
            return int((await r.readline()).split()[1])
        finally:
            w.close()

    try:
        return await asyncio.wait_for(get(), timeout)
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return None


async def hold(port: int):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(LOOP, port), 5)
        w.write(HELD_HEAD)
        await w.drain()
        return r, w
    except (OSError, asyncio.TimeoutError):
        return None


async def flood_async(svc: Service, n: int, seconds: float, every_s: float) -> dict:
    conns = await asyncio.gather(*(hold(svc.port) for _ in range(n)))
    ports = {"PORT": svc.port, **({"ADMIN_PORT": svc.admin_port} if svc.admin_port else {})}
    probes: dict[str, list] = {name: [] for name in ports}
    t0 = time.monotonic()
    for i in range(int(seconds / every_s)):
        for name, port in ports.items():
            probes[name].append(asyncio.create_task(get_status(port)))
        await asyncio.sleep(max(0.0, t0 + (i + 1) * every_s - time.monotonic()))
    table = {}
    for name, tasks in probes.items():
        got = Counter("no answer" if s is None else str(s)
                      for s in await asyncio.gather(*tasks))
        table[f"{name} /health answered 200 / sent"] = f"{got.get('200', 0)} / {len(tasks)}"
        table[f"{name} /health outcomes"] = dict(got)
    if not svc.admin_port:
        table["ADMIN_PORT /health answered 200 / sent"] = "no ADMIN_PORT in this checkout"
        table["ADMIN_PORT /health outcomes"] = "-"
    held = Counter()
    for c in conns:
        if c is None:
            held["not opened"] += 1
            continue
        try:  # a refused connection has its 503 waiting; a held one, nothing
            data = await asyncio.wait_for(c[0].read(64), 0.05)
            held[data.split(b" ")[1].decode() if data else "closed"] += 1
        except asyncio.TimeoutError:
            held["held"] += 1
        except (OSError, IndexError):
            held["reset"] += 1
        c[1].close()
    table[f"the {n} flood connections after {seconds:g} s"] = dict(held)
    return {"table": table}


def flood(svc: Service) -> dict:
    """MAX_CONNECTIONS=64; 64 × API_WORKERS + 40 connections each send a POST head
    (Content-Length: 1000) and a few body bytes, then hold; a new connection to GET /health every
    50 ms for 15 s on PORT and on ADMIN_PORT, each with 2 s to answer."""
    return asyncio.run(flood_async(svc, 64 * API_WORKERS + 40, 15.0, 0.05))


# -- 2: a short prompt behind a long one ------------------------------------------------------
def ttft(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://{LOOP}:{port}/metrics", timeout=5).text
    sums = {"count": 0.0, "sum": 0.0}
    for m in re.finditer(r"^prefill_time_to_first_token_seconds_(count|sum)(?:\{.*\})? (\S+)$",
                         text, re.M):
        sums[m.group(1)] += float(m.group(2))
    return sums["count"], sums["sum"]


def short_behind_long(svc: Service, reps: int = 3) -> dict:
    """A 5-token prompt, and 20 ms later (another thread) a 4,000-token one; three pairs, each
    with the TTFT histogram's count and sum gained over it, from /metrics."""
    post(svc.port, ids(1000, 64), 120)  # warm-up, not timed
    runs = []
    with ThreadPoolExecutor(2) as ex:
        for rep in range(reps):
            c0, s0 = ttft(svc.port)
            f_short = ex.submit(post, svc.port, [1, 2, 3, 4, 5], 120)
            time.sleep(0.02)
            f_long = ex.submit(post, svc.port, ids(rep, LONG_TOKENS), 120)
            short, long = f_short.result(), f_long.result()
            time.sleep(0.5)  # the engine's histogram files are written by then
            c1, s1 = ttft(svc.port)
            runs.append({"short": short, "long": long, "ttft_count": c1 - c0,
                         "ttft_sum_s": round(s1 - s0, 3)})
    return {"table": {
        "short prompt (5 tokens), s": [r["short"]["s"] for r in runs],
        f"long prompt ({LONG_TOKENS} tokens) 20 ms later, s": [r["long"]["s"] for r in runs],
        "statuses (short, long)": [[r["short"]["status"], r["long"]["status"]] for r in runs],
        "TTFT histogram count, sum (s) per pair": [[r["ttft_count"], r["ttft_sum_s"]]
                                                   for r in runs]}, "runs": runs}


# -- 3: malformed burst -----------------------------------------------------------------------
def burst(svc: Service, watch_s: float = 10.0) -> dict:
    """After a warm-up request, PUSHed to engine-in: a Submit with a 3-byte token buffer, one
    with no prompts, one with an empty prompt, 200 junk messages of 1-5,000 random bytes, 1 MiB
    of junk; then GET /health every 100 ms for 10 s and one legit request."""
    warm = post(svc.port, ids(2000, 16), 60)
    rng = random.Random(43)
    msgs = [submit(10**6, [b"\x01\x02\x03"]), submit(10**6 + 1, []), submit(10**6 + 2, [b""])]
    msgs += [rng.randbytes(rng.randint(1, 5000)) for _ in range(200)] + [rng.randbytes(1 << 20)]
    t0 = time.monotonic()
    sent = push(svc.sock_dir, msgs)
    t_end = time.monotonic()
    died = None if alive(svc.engine_pid) else t_end
    with ThreadPoolExecutor(1) as ex:
        f_legit = ex.submit(post, svc.port, ids(2001, 16), watch_s - 1)
        health = Counter()
        for i in range(int(watch_s / 0.1)):
            try:
                r = httpx.get(f"http://{LOOP}:{svc.port}/health", timeout=0.5)
                health[str(r.status_code)] += 1
            except httpx.HTTPError as e:
                health[type(e).__name__] += 1
            if died is None and not alive(svc.engine_pid):
                died = time.monotonic()
            time.sleep(max(0.0, t_end + (i + 1) * 0.1 - time.monotonic()))
        legit = f_legit.result()
    uptime = watch_s if died is None else max(0.0, died - t_end)
    return {"table": {
        "messages sent / built": f"{sent} / {len(msgs)} (in {t_end - t0:.2f} s)",
        "engine alive 10 s after the burst": died is None,
        "engine uptime after the burst, s": round(uptime, 1),
        "legit /v1/prefill after the burst": legit["status"],
        "/health every 100 ms for 10 s": dict(health),
        "service exit code": svc.proc.poll()}, "warm_up": warm, "legit": legit}


# -- 4: forged cancels ------------------------------------------------------------------------
def sixteen(svc: Service, seed: int, forged: list[bytes], timeout: float = 40.0) -> dict:
    """CANCEL_REQUESTS concurrent requests; `forged` PUSHed 0.5 s after they start."""
    n = CANCEL_REQUESTS
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(post, svc.port, ids(seed + k, CANCEL_TOKENS), timeout)
                for k in range(n)]
        time.sleep(0.5)  # all submitted, their forward under way
        sent = push(svc.sock_dir, forged) if forged else 0
        res = [f.result() for f in futs]
    answered = [r["s"] for r in res if isinstance(r["status"], int)]
    return {"answered": len(answered), "unanswered": n - len(answered), "forged_sent": sent,
            "before_forgery": sum(s < 0.5 for s in answered),
            "statuses": dict(Counter(str(r["status"]) for r in res)),
            "max_answered_s": max(answered, default=None), "requests": res}


def forged_cancels(svc: Service) -> dict:
    """16 concurrent requests of 128 tokens (no forgery: the control); then 16 more, with
    Cancel(w, rids 0-199) for w in 0-3 and WorkerGone for each worker PUSHed 0.5 s after they
    start; each request's client waits 40 s at most."""
    control = sixteen(svc, 3000, [])
    msgs = [msgspec.msgpack.encode(["Cancel", w, list(range(200))]) for w in range(4)]
    msgs += [msgspec.msgpack.encode(["WorkerGone", w]) for w in range(API_WORKERS)]
    forged = sixteen(svc, 3100, msgs)
    return {"table": {
        "no forgery: answered / none in 40 s": f"{control['answered']} / {control['unanswered']}",
        "no forgery: statuses": control["statuses"],
        "no forgery: slowest answer, s": control["max_answered_s"],
        "forged: answered / none in 40 s": f"{forged['answered']} / {forged['unanswered']}",
        "forged: statuses": forged["statuses"],
        "forged: slowest answer, s": forged["max_answered_s"],
        "forged: answered before the forged messages": forged["before_forgery"]},
        "control": control, "forged": forged}


# -- 5: a bad prompt in a batch ---------------------------------------------------------------
def bad_in_batch(svc: Service) -> dict:
    """While a 1,000-token request holds the engine, 3 legit 32-token requests and, at once,
    raw Submits of ids [5, 49159] and [-3, 4] (worker 0, rids 10^6 and 10^6 + 1), which queue
    for the same next batch."""
    post(svc.port, ids(4000, 16), 60)  # warm-up
    with ThreadPoolExecutor(4) as ex:
        f_long = ex.submit(post, svc.port, ids(4001, BUSY_TOKENS), 120)
        time.sleep(0.3)  # the long prompt's forward holds the engine
        legit = [ex.submit(post, svc.port, ids(4002 + k, 32), 120) for k in range(3)]
        time.sleep(0.02)
        bad = [submit(10**6, [np.asarray([5, 49152 + 7], np.int32).tobytes()]),
               submit(10**6 + 1, [np.asarray([-3, 4], np.int32).tobytes()])]
        sent = push(svc.sock_dir, bad)
        res = [f.result() for f in legit]
        long = f_long.result()
    return {"table": {
        "3 legit requests' statuses": [r["status"] for r in res],
        "their latencies, s": [r["s"] for r in res],
        f"the busy request ({BUSY_TOKENS} tokens)": f"{long['status']} in {long['s']} s",
        "bad Submits sent": sent, "engine alive after": alive(svc.engine_pid)},
        "legit": res, "long": long}


SCENARIOS = {"flood": flood, "short": short_behind_long, "burst": burst,
             "cancels": forged_cancels, "batch": bad_in_batch}
# services, each fresh: flood has its own setting; burst and cancels may leave the engine dead or
# holding requests no one will answer
SERVICES = [(["flood"], {"MAX_CONNECTIONS": "64"}), (["short", "burst"], {}), (["cancels"], {}),
            (["batch"], {})]


def cell(x: object) -> str:
    return json.dumps(x, separators=(", ", ": ")) if isinstance(x, (dict, list)) else str(x)


def markdown(runs: dict) -> str:
    labels = list(runs)
    parts = []
    for label, run in runs.items():
        meta = run["meta"]
        parts.append(f"- **{label}**: `{meta['repo']}` at {meta['commit']}, "
                     f"`{meta['command']}`, {meta['date']}, python {meta['python']}, "
                     f"torch {meta['torch']}, {meta['cpus']} CPUs (load {meta['loadavg']})")
    for name in SCENARIOS:
        table = {}
        for label in labels:
            r = runs[label]["scenarios"].get(name, {"table": {"error": "not run"}})
            for what, x in r["table"].items():
                table.setdefault(what, {})[label] = cell(x)
        body = [[what, *(v.get(lb, "") for lb in labels)] for what, v in table.items()]
        doc = " ".join(SCENARIOS[name].__doc__.split())
        parts.append(f"\n## {name}\n\n{doc}\n\n" + markdown_table(["", *labels], body))
    return "\n".join(parts)


def meta(repo: Path, python: str, service_file: str) -> dict:
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                                    text=True).stdout.strip()
    base = run_meta()
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--", "service") else ""
    return {"command": shlex.join([python, *sys.argv]), "date": base["date"],
            "repo": str(repo), "commit": git("rev-parse", "--short", "HEAD") + dirty,
            "service_package": service_file, "python": base["python"], "torch": base["torch"],
            "cpus": os.cpu_count(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "api_workers": API_WORKERS}


def run_scenarios(svc: Service, names: list[str]) -> dict:
    out = {}
    for name in names:
        t0, load, log_at = time.monotonic(), os.getloadavg()[0], len(svc.log())
        try:
            r = SCENARIOS[name](svc)
        except Exception as e:  # noqa: BLE001 - one scenario's failure is a result
            r = {"table": {"error": f"{type(e).__name__}: {e}"}}
        lines = svc.log()[log_at:].splitlines()
        tb, err, warn = (sum(w in ln for ln in lines)
                         for w in ("Traceback", " ERROR ", " WARNING "))
        # an exception's last line: "[module.]Name: message", the line a traceback ends with
        r["exceptions"] = list(dict.fromkeys(
            ln[:200] for ln in lines if re.match(r"^[A-Za-z_][\w.]*: \S", ln)))
        r["table"].update({
            "service log: Traceback / ERROR / WARNING lines":
                f"{tb} / {err} / {warn}",
            "service log: first exception": r["exceptions"][0] if r["exceptions"] else "none",
            "host load average (1 min) at its start": round(load, 2)})
        r["wall_s"] = round(time.monotonic() - t0, 1)
        print(f"\n{name} ({r['wall_s']} s)")
        for what, x in r["table"].items():
            print(f"  {what:48s} {cell(x)}")
        out[name] = r
    return out


def run_checkout(repo: Path, python: str, only: set[str], logs: Path | None,
                 label: str) -> dict:
    """Every scenario in `only` against `repo`'s service, a fresh one per SERVICES entry."""
    scenarios = {}
    with tempfile.TemporaryDirectory(prefix="hardening-") as tmp:
        for names, extra in SERVICES:
            if not (names := [n for n in names if n in only]):
                continue
            try:
                svc = Service(repo, python, Path(tmp), extra)
            except (RuntimeError, AssertionError, ValueError) as e:
                scenarios.update({n: {"table": {"error": str(e)[-300:]}} for n in names})
                continue
            try:
                scenarios.update(run_scenarios(svc, names))
            finally:
                svc.stop()
                if logs:
                    logs.mkdir(parents=True, exist_ok=True)
                    (logs / f"{label}-{'-'.join(names)}.log").write_text(svc.log())
    return scenarios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose service runs")
    ap.add_argument("--label", default="after", help="this run's column (before, after)")
    ap.add_argument("--out", type=Path, help="<path> for <path>.json and <path>.md; merged")
    ap.add_argument("--only", help="comma-separated scenarios (default: all)")
    ap.add_argument("--logs", type=Path, help="a folder to copy the service's logs into")
    args = ap.parse_args()
    repo, python = args.repo.resolve(), sys.executable
    service_file = checkout_service(repo, python)
    run = {"meta": meta(repo, python, service_file)}
    print(f"{args.label}: {repo} at {run['meta']['commit']} ({service_file})")
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    run["scenarios"] = run_checkout(repo, python, only, args.logs, args.label)
    if args.out:
        path = Path(f"{args.out}.json")
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        runs[args.label] = run
        path.write_text(json.dumps({"runs": runs}, indent=1))
        Path(f"{args.out}.md").write_text(
            f"# {args.out.name}\n\nIssue 43's scenarios (`bench/hardening.py`), one column per "
            f"checkout.\n\n{markdown(runs)}\n")
        print(f"\nwrote {path} and {args.out}.md")


if __name__ == "__main__":
    main()
