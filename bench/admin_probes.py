"""Probes and oversized bodies against `python -m service` in --repo (CPU, API_WORKERS=1, a
fresh service per run, on loopback): probes answered through a flood of idle and partial
connections to ADMIN_PORT, probes answered while the API worker is stopped (SIGSTOP), and how a
client that sends a 9 MB body before it reads sees the 413. Each run adds its column (--label)
to --out's JSON and prints the table.

  git worktree add /tmp/probes-before <commit>
  python bench/admin_probes.py --repo /tmp/probes-before --label before --out /tmp/probes.json
  python bench/admin_probes.py --repo . --label after --out /tmp/probes.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

LOOP = "127.0.0.1"
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: bench\r\n"
BODY = b"x" * 9_000_000  # over the default MAX_BODY_BYTES (8 MiB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


class Service:
    """`python -m service` in `repo`, in its own process group and TMPDIR, ready."""

    def __init__(self, repo: Path):
        self.tmp = Path(tempfile.mkdtemp(prefix="probes-"))
        self.port, self.admin_port = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(repo), "TMPDIR": str(self.tmp), "HOST": LOOP,
               "PORT": str(self.port), "ADMIN_PORT": str(self.admin_port), "API_WORKERS": "1",
               "LOG_LEVEL": "info", "ACCESS_LOG": "false"}
        self.log = self.tmp / "service.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=repo, env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 300
        while status(self.admin_port, "/ready") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)
        self.worker = int(re.findall(r"started API worker \d+ \(pid (\d+)\)",
                                     self.log.read_text())[0])

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def status(port: int, path: str, timeout: float = 2.0) -> int | str:
    try:
        return httpx.get(f"http://{LOOP}:{port}{path}", timeout=timeout).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def probes(port: int, seconds: float, timeout: float) -> dict:
    """GET /health and /ready in turn every 100 ms, each on a new connection."""
    got, seconds_200 = Counter(), []
    end = time.monotonic() + seconds
    for i in range(10**9):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        s = status(port, ("/health", "/ready")[i % 2], timeout)
        got[str(s)] += 1
        if s == 200:
            seconds_200.append(time.perf_counter() - t0)
        time.sleep(0.1)
    q = (statistics.quantiles(seconds_200, n=100, method="inclusive")
         if len(seconds_200) > 1 else [0.0] * 99)
    return {"answered 200 / sent": f"{got['200']} / {sum(got.values())}",
            "outcomes": dict(got), "p50 / p99 / max of the 200s (ms)": " / ".join(
                f"{x * 1000:.1f}" for x in (q[49], q[98], max(seconds_200, default=0.0)))}


def flood(svc: Service, idle: int = 150, partial: int = 50, seconds: float = 30.0) -> dict:
    """`idle` silent connections and `partial` ones inside a head, held to ADMIN_PORT (each one
    the server closes or answers opened again, every 0.5 s), while probes run."""
    def open_(i: int) -> socket.socket:
        s = socket.create_connection((LOOP, svc.admin_port), timeout=5)
        if i < partial:
            s.sendall(PARTIAL_HEAD)
        return s

    socks = [open_(i) for i in range(idle + partial)]
    stop, reopened = threading.Event(), [0]

    def hold() -> None:
        while not stop.wait(0.5):
            ready = set(select.select(socks, [], [], 0)[0])
            for i, s in enumerate(socks):
                if s in ready:
                    s.close()
                    socks[i] = open_(i)
                    reopened[0] += 1

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    out = probes(svc.admin_port, seconds, timeout=2.0)
    stop.set()
    t.join()
    for s in socks:
        s.close()
    return {**out, "flood connections reopened": reopened[0]}


def stopped_worker(svc: Service, seconds: float = 5.0) -> dict:
    """SIGSTOP the API worker for `seconds`; probes with a 1 s timeout meanwhile."""
    os.kill(svc.worker, signal.SIGSTOP)
    try:
        return probes(svc.admin_port, seconds, timeout=1.0)
    finally:
        os.kill(svc.worker, signal.SIGCONT)


def oversized(svc: Service, tries: int = 30) -> dict:
    """A 9 MB POST with Content-Length, sent whole before reading: over a raw socket (what
    the connection does), and through http.client (what a typical client reports)."""
    head = (b"POST /v1/prefill HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY))
    raw, client = Counter(), Counter()
    for _ in range(tries):
        sent, data = True, b""
        with socket.create_connection((LOOP, svc.port), timeout=10) as s:
            try:
                s.sendall(head + BODY)
            except OSError:
                sent = False
            try:
                while chunk := s.recv(65536):
                    data += chunk
                end = "clean close"
            except OSError as e:
                end = type(e).__name__
        got = "413 read" if data.startswith(b"HTTP/1.1 413") else "no 413"
        raw[f"{got}, {'body sent' if sent else 'reset while sending'}, then {end}"] += 1
        conn = http.client.HTTPConnection(LOOP, svc.port, timeout=10)
        try:
            conn.request("POST", "/v1/prefill", BODY, {"Content-Type": "application/json"})
            client[str(conn.getresponse().status)] += 1
        except OSError as e:
            client[type(e).__name__] += 1
        finally:
            conn.close()
    return {"raw socket": dict(raw), "http.client": dict(client)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    svc = Service(args.repo.resolve())
    try:
        rev = subprocess.run(["git", "-C", str(args.repo), "describe", "--always", "--dirty"],
                             capture_output=True, text=True).stdout.strip()
        col = {"commit": rev,
               "probes through 200 idle/partial ADMIN_PORT connections, 30 s": flood(svc),
               "probes while the API worker is SIGSTOPped, 5 s": stopped_worker(svc),
               "9 MB body over MAX_BODY_BYTES, 30 tries": oversized(svc)}
    finally:
        svc.stop()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = col
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
