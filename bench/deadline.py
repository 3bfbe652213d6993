"""A deadline shorter than a long prompt: how long the next request waits, how long the engine
keeps computing the abandoned prompt.

Starts `python -m service` in --repo (bench/hardening_service.py: loopback, its own TMPDIR and
process group) with REQUEST_TIMEOUT_S, sends one short warm-up prompt, then a --tokens prompt
that the deadline answers with a 504, then at once a 3-token prompt. Reports the 504's time, the
short request's status and wait, and, from the 504 on, how long the engine's
prefill_running_requests stayed above 0 and the engine process's CPU seconds meanwhile.

  git worktree add /tmp/deadline-before <commit>
  python bench/deadline.py --repo /tmp/deadline-before --label before --out <path>.json
  python bench/deadline.py --repo . --label after --out <path>.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import run_meta  # noqa: E402
from bench.hardening_service import LOOP, Service, post, proc_stat  # noqa: E402

POLL_S = 0.2


class DeadlineService(Service):
    def _engine_pid(self) -> int:
        """The supervisor's first child (the engine starts first), whatever else it started."""
        kids = []
        for d in Path("/proc").iterdir():
            stat = proc_stat(int(d.name)) if d.name.isdigit() else None
            if stat and int(stat[1]) == self.proc.pid and b"resource_tracker" not in (
                    d / "cmdline").read_bytes():
                kids.append((int(stat[19]), int(d.name)))
        return min(kids)[1]


def ids(n: int) -> list[int]:
    return [(i * 7919) % 49000 + 10 for i in range(n)]


def running(port: int) -> float:
    text = httpx.get(f"http://{LOOP}:{port}/metrics", timeout=10).text
    return float(re.search(r"^prefill_running_requests(?:\{.*\})? (\S+)$", text, re.M)[1])


def cpu_s(pid: int) -> float:
    stat = proc_stat(pid)
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") if stat else 0.0


def measure(svc: Service, tokens: int, busy_cap_s: float) -> dict:
    for _ in range(5):  # warm-up, not timed: a cold engine's first forwards can miss the deadline
        if post(svc.port, [1, 2, 3, 4, 5], 120)["status"] == 200:
            break
    long = post(svc.port, ids(tokens), 600)
    t504, cpu0 = time.monotonic(), cpu_s(svc.engine_pid)
    short = post(svc.port, [1, 2, 3], 600)
    while running(svc.port) > 0 and time.monotonic() - t504 < busy_cap_s:
        time.sleep(POLL_S)
    busy = time.monotonic() - t504
    return {"long": long, "short": short, "busy_after_504_s": round(busy, 1),
            "busy_capped": busy >= busy_cap_s,
            "engine_cpu_s_after_504": round(cpu_s(svc.engine_pid) - cpu0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose service runs")
    ap.add_argument("--label", default="after")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="REQUEST_TIMEOUT_S")
    ap.add_argument("--busy-cap-s", type=float, default=600.0, help="stop watching after")
    ap.add_argument("--out", type=Path, help="a JSON file; this run is merged in by --label")
    args = ap.parse_args()
    env = {"REQUEST_TIMEOUT_S": str(args.timeout_s), "DEVICE": "cpu"}
    with tempfile.TemporaryDirectory(prefix="deadline-") as tmp:
        svc = DeadlineService(args.repo.resolve(), sys.executable, Path(tmp), env)
        try:
            run = {"meta": {**run_meta(), "repo": str(args.repo), "env": env,
                            "tokens": args.tokens, "cpus": os.cpu_count(),
                            "loadavg_1min": os.getloadavg()[0]},
                   **measure(svc, args.tokens, args.busy_cap_s)}
        finally:
            svc.stop()
    print(json.dumps(run, indent=1))
    if args.out:
        runs = json.loads(args.out.read_text()) if args.out.exists() else {}
        runs[args.label] = run
        args.out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
