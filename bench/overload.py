"""The service under hostile load, on loopback: what its clients and its probes see.

Starts `python -m service` (CPU or GPU, whatever the machine has) and runs one scenario:

  retry-storm  goodput (successful prefills/s) of --clients-sat clients, as many as the queue
               holds, against --clients-storm clients that retry each 429 after --retry-ms
               without honouring Retry-After; prints both, their ratio, the 429 rate and the
               Retry-After values seen.
  big-bodies   /health latency (every 20 ms) while --bodies clients each post a prompt body of
               MAX_BODY_BYTES, far over the prompt limit; prints its p50/p99/max, what the big
               requests got and how long they took.

Clients are raw asyncio sockets with prebuilt requests, in their own process, so that they cost
far less CPU than the server they measure. --out writes the result as JSON.

  python bench/overload.py retry-storm --queue 64 --clients-sat 64 --clients-storm 256
  python bench/overload.py big-bodies --bodies 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MAX_BODY_BYTES = 8 << 20  # the service's default


def post_bytes(body: bytes, path: bytes = b"/v1/prefill") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path, len(body))) + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.strip().lower()] = v.strip()
    await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return int(lines[0].split()[1]), headers


# -- retry storm ------------------------------------------------------------------------------
async def retrying_client(port: int, req: bytes, retry_s: float, until: float, out: dict) -> None:
    reader = writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            status, headers = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError):
            writer = None
            out["errors"] += 1
            await asyncio.sleep(retry_s)
            continue
        if headers.get(b"connection") == b"close":
            writer.close()
            writer = None
        if status == 200:
            out["ok"] += 1
        elif status == 429:
            out["rejected"] += 1
            ra = headers.get(b"retry-after", b"?").decode()
            out["retry_after"][ra] = out["retry_after"].get(ra, 0) + 1
            await asyncio.sleep(retry_s)
        else:
            out["other"][str(status)] = out["other"].get(str(status), 0) + 1
    if writer is not None:
        writer.close()


def storm_clients(port: int, n: int, prompt: str, retry_s: float, seconds: float, q) -> None:
    async def main() -> dict:
        out = {"ok": 0, "rejected": 0, "errors": 0, "retry_after": {}, "other": {}}
        until = time.monotonic() + seconds
        t0 = time.process_time()
        req = post_bytes(json.dumps({"prompt": prompt}).encode())
        await asyncio.gather(*(retrying_client(port, req, retry_s, until, out)
                               for _ in range(n)))
        out["client_cpu_s"] = time.process_time() - t0
        return out

    q.put(asyncio.run(main()))


def storm_phase(port: int, n: int, prompt: str, retry_s: float, seconds: float) -> dict:
    out = in_process(storm_clients, port, n, prompt, retry_s, seconds, timeout=seconds + 120)
    out.update(clients=n, seconds=seconds, goodput_rps=out["ok"] / seconds,
               rejected_rps=out["rejected"] / seconds,
               client_cpu_share=out["client_cpu_s"] / seconds)
    return out


def retry_storm(port: int, args: argparse.Namespace) -> dict:
    retry_s = args.retry_ms / 1e3
    storm_phase(port, args.clients_sat, args.prompt, retry_s, 3.0)  # warm-up
    sat = storm_phase(port, args.clients_sat, args.prompt, retry_s, args.seconds)
    storm = storm_phase(port, args.clients_storm, args.prompt, retry_s, args.seconds)
    for name, r in (("saturation", sat), ("storm", storm)):
        print(f"{name:10s} {r['clients']:4d} clients: {r['goodput_rps']:8.1f} ok/s "
              f"{r['rejected_rps']:8.1f} 429/s  client CPU {r['client_cpu_share']:.0%}  "
              f"Retry-After {r['retry_after']}  other {r['other']} errors {r['errors']}")
    ratio = storm["goodput_rps"] / max(sat["goodput_rps"], 1e-9)
    print(f"goodput under the storm / at saturation: {ratio:.2f}")
    return {"queue": args.queue, "retry_ms": args.retry_ms, "saturation": sat, "storm": storm,
            "ratio": ratio}


# -- big bodies -------------------------------------------------------------------------------
def big_body_clients(port: int, n: int, q) -> None:
    # ~8 MB of prose, as JSON: one prompt of ~1.8 M tokens, far over any prompt limit
    text = "The quick brown fox jumps over the lazy dog. " * (MAX_BODY_BYTES // 46 - 100)
    req = post_bytes(json.dumps({"prompt": text}).encode())

    async def one() -> tuple[int, float]:
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(req)
        status, _ = await read_response(reader)
        writer.close()
        return status, time.perf_counter() - t0

    async def main() -> list:
        return await asyncio.gather(*(one() for _ in range(n)))

    q.put(asyncio.run(main()))


def big_bodies(port: int, args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{port}/health"
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=big_body_clients, args=(port, args.bodies, q))
    lat: list[float] = []
    with httpx.Client(timeout=30) as c:
        c.get(url)
        p.start()
        t_end = None
        failed = 0
        while t_end is None or time.monotonic() < t_end:
            t0 = time.perf_counter()
            try:
                c.get(url)
            except httpx.TransportError:
                failed += 1
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
            if t_end is None and not p.is_alive():
                t_end = time.monotonic() + 0.5
            if t_end is None and not q.empty():
                t_end = time.monotonic() + 0.5
    answers = q.get(timeout=300)
    p.join()
    lat.sort()
    ms = [x * 1e3 for x in lat]
    res = {"bodies": args.bodies, "body_bytes": MAX_BODY_BYTES, "health_probes": len(ms),
           "health_p50_ms": statistics.median(ms), "health_p99_ms": ms[int(0.99 * (len(ms) - 1))],
           "health_max_ms": ms[-1], "health_failed": failed,
           "big_statuses": [s for s, _ in answers],
           "big_seconds": [round(t, 3) for _, t in answers]}
    print(f"/health while {args.bodies} bodies of {MAX_BODY_BYTES} bytes are processed: "
          f"p50 {res['health_p50_ms']:.1f} ms, p99 {res['health_p99_ms']:.1f} ms, "
          f"max {res['health_max_ms']:.1f} ms over {len(ms)} probes ({failed} failed); the "
          "bodies got "
          f"{res['big_statuses']} after {res['big_seconds']} s")
    return res


# -- harness ----------------------------------------------------------------------------------
def in_process(target, *args, timeout: float):
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=target, args=(*args, q))
    p.start()
    out = q.get(timeout=timeout)
    p.join()
    return out


def serve(env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1", "ACCESS_LOG": "false",
           "LOG_LEVEL": "warning", **env}
    server = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return server, port
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            sys.exit("the service did not become ready")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=["retry-storm", "big-bodies"])
    ap.add_argument("--queue", type=int, default=64, help="MAX_QUEUE_REQUESTS of the server")
    ap.add_argument("--clients-sat", type=int, default=64)
    ap.add_argument("--clients-storm", type=int, default=256)
    ap.add_argument("--retry-ms", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--bodies", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    server, port = serve({"MAX_QUEUE_REQUESTS": str(args.queue)})
    try:
        result = (retry_storm if args.scenario == "retry-storm" else big_bodies)(port, args)
    finally:
        server.terminate()
        server.wait(60)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "scenario": args.scenario,
                                        "date": time.strftime("%Y-%m-%d"), **result}, indent=1))


if __name__ == "__main__":
    main()
