"""Requests carrying 100k invented field names: log lines and bytes written, the worker's RSS
growth, and how long /health on the same worker stalls, against a service this script starts.

Starts `python -m service` in --repo (that checkout's own `service` package, CPU, API_WORKERS=1,
LOG_LEVEL=warning) as bench/hardening.py does, on loopback ports 18300-18349, probes /health on
PORT every 20 ms while it sends --requests completions of --keys unknown fields each (new names
in each), one after another; then stops the service. Each run adds its column (--label) to
--out's JSON and rewrites the markdown beside it.

  git worktree add /tmp/base-a3 4e9fb18
  python bench/unknown_fields.py --repo /tmp/base-a3 --label before --out bench/results/<name>
  python bench/unknown_fields.py --repo . --label after --out bench/results/<name>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hardening_service  # noqa: E402
from bench.common import markdown_table  # noqa: E402
from bench.hardening import meta  # noqa: E402
from bench.hardening_service import LOOP, Service, checkout_service, proc_stat  # noqa: E402

PORTS = iter(range(18300, 18350))


class OneWorker(Service):
    """hardening_service's Service with one API worker; the engine's pid is not needed."""

    def _engine_pid(self) -> int:
        return 0


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker_pid(svc: Service) -> int:
    """The supervisor's child that holds PORT's listening socket (the API worker)."""
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if line.split()[1].endswith(f":{svc.port:04X}") and line.split()[3] == "0A"}
    for d in Path("/proc").iterdir():
        stat = proc_stat(int(d.name)) if d.name.isdigit() else None
        if not stat or int(stat[1]) != svc.proc.pid:
            continue
        try:
            fds = {os.readlink(f) for f in (d / "fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{i}]" in fds for i in inodes):
            return int(d.name)
    raise RuntimeError("no worker holds PORT")


def probe(port: int, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=f"http://{LOOP}:{port}", timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get("/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def measure(repo: Path, python: str, keys: int, requests: int) -> dict:
    hardening_service.API_WORKERS = 1
    hardening_service.free_port = lambda: next(PORTS)
    svc = OneWorker(repo, python, Path(tempfile.gettempdir()), {"API_WORKERS": "1"})
    try:
        pid = worker_pid(svc)
        log0, rss0 = svc.log_path.stat().st_size, rss_kb(pid)
        lines0 = svc.log().count("\n")
        latencies: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(svc.port, stop, latencies))
        prober.start()
        time.sleep(1.0)
        calm = len(latencies)
        seconds, statuses = [], []
        for i in range(requests):
            body = {"prompt": "Hello", "max_tokens": 1,
                    **{f"invented_{i}_{j}": j for j in range(keys)}}
            t0 = time.perf_counter()
            r = httpx.post(f"http://{LOOP}:{svc.port}/v1/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"}, timeout=300)
            seconds.append(round(time.perf_counter() - t0, 3))
            statuses.append(r.status_code)
        time.sleep(1.0)
        stop.set()
        prober.join()
        time.sleep(0.5)  # the log handler flushes
        loaded = np.array(latencies[calm:]) * 1e3
        return {"statuses": statuses, "request_s": seconds,
                "log_lines": svc.log().count("\n") - lines0,
                "log_bytes": svc.log_path.stat().st_size - log0,
                "worker_rss_growth_mb": round((rss_kb(pid) - rss0) / 1024, 1),
                "worker_peak_rss_mb": round(rss_kb(pid, "VmHWM") / 1024, 1),
                "health_probes": len(loaded), "health_worst_ms": round(float(loaded.max()), 1),
                "health_p99_ms": round(float(np.percentile(loaded, 99)), 1)}
    finally:
        svc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose service runs")
    ap.add_argument("--label", default="after", help="this run's column (before, after)")
    ap.add_argument("--out", type=Path, help="<path> for <path>.json and <path>.md; merged")
    ap.add_argument("--keys", type=int, default=100_000, help="unknown fields per request")
    ap.add_argument("--requests", type=int, default=3)
    args = ap.parse_args()
    repo, python = args.repo.resolve(), sys.executable
    service_file = checkout_service(repo, python)
    run = {"meta": {**meta(repo, python, service_file), "api_workers": 1},
           "result": measure(repo, python, args.keys, args.requests)}
    print(json.dumps(run["result"], indent=1))
    if args.out:
        path = Path(f"{args.out}.json")
        runs = json.loads(path.read_text())["runs"] if path.exists() else {}
        runs[args.label] = run
        path.write_text(json.dumps({"runs": runs}, indent=1))
        rows = [[k, *(r["result"][k] for r in runs.values())] for k in run["result"]]
        commands = "\n".join(f"- {label}: `{r['meta']['command']}` ({r['meta']['commit']})"
                             for label, r in runs.items())
        Path(f"{args.out}.md").write_text(
            f"# {args.out.name}\n\n{args.requests} completions with {args.keys} invented "
            f"fields each (`bench/unknown_fields.py`), CPU, API_WORKERS=1.\n\n{commands}\n\n"
            f"{markdown_table(['', *runs], rows)}\n")
        print(f"wrote {path} and {args.out}.md")


if __name__ == "__main__":
    main()
