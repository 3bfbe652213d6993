"""Big bodies against one API worker (issue 48, item 1): four loads, each 4 concurrent requests
of about 8 MB, while /health is probed every ~20 ms on PORT (the worker's own event loop) and
on ADMIN_PORT.

Loads: /tokenize of an 8 MB prompt; chat with an 8 MB message and truncate_prompt_tokens; a
completion of an 8 MB prompt with truncate_prompt_tokens; /detokenize of 3.9M ids; and, for
comparison, 4 completions of a 300-character prompt (the engine's CPU forwards compete with the
worker for the host's cores: the probes' floor on a CPU host). Each load gets a fresh
`python -m service` from --repo (its own `service` package, on the CPU, with API_WORKERS=1;
bench/hardening_service.py's Service). Recorded per load: worst and p99 probe latency per port
and the probes that failed (and the p99 of the 2 s before the load: the host's own noise), the
requests' statuses and seconds, and the API worker's RSS before the load and its peak during it
(VmHWM after a reset through clear_refs, and VmRSS sampled with every probe), after one small
completion has warmed the engine. Each run adds its column (--label) to --out's JSON and
rewrites the markdown beside it.

  git -C /work/main worktree add /tmp/base-a2 4e9fb18
  (cd /tmp/base-a2 && /work/main/.venv/bin/python /work/main/bench/big_bodies.py \
      --repo /tmp/base-a2 --label before)
  .venv/bin/python bench/big_bodies.py --repo . --label after
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import markdown_table  # noqa: E402
from bench.hardening_service import LOOP, Service  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "big-bodies-cpu-2026-12-04"
CONCURRENT = 4
TEXT_CHARS = 7_800_000  # with its JSON escapes, the body stays under MAX_BODY_BYTES
MAX_BODY_BYTES = 8 << 20
DETOKENIZE_IDS = 3_900_000  # single-digit ids: "d," each
KEEP = 64  # truncate_prompt_tokens
PROBE_EVERY_S, PROBES_IN_FLIGHT, PROBE_TIMEOUT_S = 0.02, 32, 30.0
IDLE_S = 2.0  # probes before the load starts: the host's own noise
WARM_UP = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which "
         "be this has had not but what all when there can said who will more no if out so up "
         "one about into than them could time only new some these two may first then do any "
         "like my now over such our man me even most made after also did many before must "
         "through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three café naïve "
         "Straße 2024 3.14 x_y <tag> (paren) \"quote\" it's we'll").split()


def text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, n = [], 0
    while n < chars:
        w = rng.choice(WORDS) + rng.choice((" ", " ", " ", " ", " ", ", ", ". ", ".\n", "\n\n"))
        parts.append(w)
        n += len(w)
    return "".join(parts)[:chars]


def bodies() -> dict[str, tuple[str, bytes]]:
    """load -> (path, body); the bodies are built once and sent as bytes."""
    big = text(TEXT_CHARS)
    dump = lambda x: json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode()
    ids = ",".join(str(i % 10) for i in range(DETOKENIZE_IDS))
    out = {
        "tokenize": ("/tokenize", dump({"prompt": big})),
        "chat_truncate": ("/v1/chat/completions", dump({
            "messages": [{"role": "user", "content": big}], "max_tokens": 1,
            "truncate_prompt_tokens": KEEP})),
        "completions_truncate": ("/v1/completions", dump({
            "prompt": big, "max_tokens": 1, "truncate_prompt_tokens": KEEP})),
        "detokenize": ("/detokenize", f'{{"tokens":[{ids}]}}'.encode()),
        # the floor: what the engine's CPU forwards alone do to the probes on this host
        "control_small_completions": ("/v1/completions", dump({
            "prompt": big[:300], "max_tokens": 1})),
    }
    assert all(len(b) <= MAX_BODY_BYTES for _, b in out.values()), "a body over MAX_BODY_BYTES"
    return out


class OneWorker(Service):
    def _engine_pid(self) -> int:
        return 0  # the worker is found by its PORT socket (worker_pid)


def worker_pid(svc: Service) -> int:
    """The supervisor's child that holds a socket listening on PORT."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == svc.port and f[3] == "0A":
                inodes.add(f"socket:[{f[9]}]")
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[
                    1]) != svc.proc.pid:
                continue
            if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                return int(d.name)
        except OSError:
            continue
    raise RuntimeError(f"no child of {svc.proc.pid} listens on {svc.port}")


def mem_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


async def probe(port: int) -> float | None:
    """Seconds for GET /health to answer 200, None if it failed or took PROBE_TIMEOUT_S."""
    async def get() -> bool:
        r, w = await asyncio.open_connection(LOOP, port)
        try:
            w.write(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            return (await r.readline()).split()[1] == b"200"
        finally:
            w.close()

    t0 = time.perf_counter()
    try:
        ok = await asyncio.wait_for(get(), PROBE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError, IndexError):
        ok = False
    return time.perf_counter() - t0 if ok else None


async def prober(port: int, done: asyncio.Event, out: list, rss: list, pid: int) -> None:
    slots, tasks = asyncio.Semaphore(PROBES_IN_FLIGHT), []

    async def one() -> None:
        t = time.monotonic()
        try:
            out.append((t, await probe(port)))
        finally:
            slots.release()

    while not done.is_set():
        await slots.acquire()
        tasks.append(asyncio.ensure_future(one()))
        rss.append(mem_mb(pid, "VmRSS"))
        await asyncio.sleep(PROBE_EVERY_S)
    await asyncio.gather(*tasks)


def send(port: int, path: str, body: bytes) -> dict:
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"http://{LOOP}:{port}{path}", content=body, timeout=900,
                       headers={"Content-Type": "application/json"})
        status, size = r.status_code, len(r.content)
        detail = r.text[:200] if status != 200 else ""
    except httpx.HTTPError as e:
        status, size, detail = type(e).__name__, 0, str(e)[:200]
    return {"status": status, "s": round(time.perf_counter() - t0, 2), "bytes": size,
            "detail": detail}


async def run_load(svc: Service, pid: int, path: str, body: bytes, senders: Executor) -> dict:
    done, rss = asyncio.Event(), []
    probes = {name: [] for name in ("PORT", "ADMIN_PORT")}
    ports = {"PORT": svc.port, "ADMIN_PORT": svc.admin_port}
    tasks = [asyncio.ensure_future(prober(ports[k], done, v, rss, pid))
             for k, v in probes.items() if ports[k]]
    await asyncio.sleep(IDLE_S)
    t_load = time.monotonic()
    results = await asyncio.gather(*[asyncio.wrap_future(senders.submit(
        send, svc.port, path, body)) for _ in range(CONCURRENT)])
    await asyncio.sleep(1.0)
    done.set()
    await asyncio.gather(*tasks)
    return {"requests": results, "rss_samples_peak_mb": max(rss),
            "idle": {k: [x for t, x in v if t < t_load] for k, v in probes.items()},
            "probes": {k: [x for t, x in v if t >= t_load] for k, v in probes.items()}}


def summary(probes: list[float | None]) -> dict:
    ok = sorted(x for x in probes if x is not None)
    p99 = ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None
    return {"n": len(probes), "failed": len(probes) - len(ok),
            "worst_ms": round(ok[-1] * 1e3, 1) if ok else None,
            "p99_ms": round(p99 * 1e3, 1) if ok else None}


def one_load(repo: Path, python: str, name: str, path: str, body: bytes) -> dict:
    with tempfile.TemporaryDirectory(prefix="big-bodies-") as tmp:
        svc = OneWorker(repo, python, Path(tmp), {"API_WORKERS": "1"})
        try:
            pid = worker_pid(svc)
            warm = send(svc.port, "/v1/completions", WARM_UP)  # the engine's first forward
            assert warm["status"] == 200, warm
            before = mem_mb(pid, "VmRSS")
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                reset = True
            except OSError:
                reset = False
            # NOTE: senders in processes of their own (forked before the probes' loop runs):
            # in threads, reading the big answers would delay this process's probes
            with ProcessPoolExecutor(CONCURRENT, mp_context=multiprocessing.get_context(
                    "fork")) as senders:
                list(senders.map(abs, range(CONCURRENT)))
                run = asyncio.run(run_load(svc, pid, path, body, senders))
            hwm = mem_mb(pid, "VmHWM") if reset else None
        finally:
            svc.stop()
    peak = max(run["rss_samples_peak_mb"], hwm or 0.0)
    reqs = run["requests"]
    return {"table": {
        **{f"{k} /health {m}": summary(v)[m] for k, v in run["probes"].items()
           for m in ("worst_ms", "p99_ms", "failed", "n")},
        **{f"{k} /health p99_ms before the load (idle)": summary(v)["p99_ms"]
           for k, v in run["idle"].items()},
        "worker RSS before, MB": round(before, 1), "worker peak RSS, MB": round(peak, 1),
        "worker RSS growth, MB": round(peak - before, 1),
        "statuses": dict(Counter(str(r["status"]) for r in reqs)),
        "slowest request, s": max(r["s"] for r in reqs),
        "answer bytes": sorted({r["bytes"] for r in reqs})},
        "body_bytes": len(body), "vmhwm_mb": hwm, **run}


def meta(repo: Path, python: str) -> dict:
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                                    text=True).stdout.strip()
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--", "service") else ""
    return {"command": shlex.join([python, *sys.argv]), "repo": str(repo),
            "commit": git("rev-parse", "--short", "HEAD") + dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg())}


def markdown(runs: dict) -> str:
    labels = list(runs)
    parts = [f"# {OUT.name}\n\nIssue 48 item 1 (`bench/big_bodies.py`): {CONCURRENT} concurrent "
             "requests per load against one API worker, /health probed every ~20 ms on PORT "
             "and ADMIN_PORT; one column per checkout.\n"]
    for label in labels:
        metas = [r["meta"] for r in runs[label]["loads"].values()]
        for m in {(m["commit"], m["command"]): m for m in reversed(metas)}.values():
            parts.append(f"- **{label}**: `{m['repo']}` at {m['commit']}, `{m['command']}`, "
                         f"{m['date']}, {m['cpus']} CPUs (load {m['loadavg']})")
    names = dict.fromkeys(n for label in labels for n in runs[label]["loads"])
    for name in names:
        table: dict[str, dict] = {}
        for label in labels:
            for what, x in runs[label]["loads"].get(name, {"table": {}})["table"].items():
                table.setdefault(what, {})[label] = json.dumps(x) if isinstance(x, (dict, list)) \
                    else x
        rows = [[what, *(v.get(lb, "") for lb in labels)] for what, v in table.items()]
        parts.append(f"\n## {name}\n\n" + markdown_table(["", *labels], rows))
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose service runs")
    ap.add_argument("--label", default="after", help="this run's column (before, after)")
    ap.add_argument("--out", type=Path, default=OUT, help="<path>.json and <path>.md; merged")
    ap.add_argument("--only", nargs="*", help="loads to run (default: all)")
    args = ap.parse_args()
    repo, python = args.repo.resolve(), sys.executable
    path = Path(f"{args.out}.json")
    runs = json.loads(path.read_text()) if path.exists() else {}
    loads = runs.setdefault(args.label, {"loads": {}})["loads"]  # --only replaces those loads
    for name, (path_, body) in bodies().items():
        if args.only and name not in args.only:
            continue
        print(f"{args.label}: {name} ({len(body)} bytes) ...", flush=True)
        loads[name] = r = one_load(repo, python, name, path_, body)
        r["meta"] = meta(repo, python)
        print(json.dumps(r["table"]), flush=True)
    path.write_text(json.dumps(runs, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(markdown(runs))
    print(f"wrote {path} and {args.out}.md")


if __name__ == "__main__":
    main()
